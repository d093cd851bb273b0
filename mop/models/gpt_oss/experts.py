"""gpt-oss's MoE: a biased top-k router and biased experts with a clamped SwiGLU.

Router: `logits = x W^T + b` (in the activations' dtype, as the reference); the top-k logits are
chosen and softmaxed among themselves (the weights sum to one); the probabilities the balance
statistics sum are the fp32 softmax over all experts, as HF's `load_balancing_loss_func` takes
them from the logits.

Expert e: `gate_up = x W_e + b_e` (`[2I]`, gate and up columns interleaved: gate = even columns,
up = odd ones), `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
`h = (up + 1) * gate * sigmoid(alpha * gate)`, `out = h D_e + d_e`; a token's output is the
routing-weighted sum over its k experts.

Storage: the reference's layout, stacked along E so an expert partition is a slice along dim 0:
`gate_up_weight [E, H, 2I]` (x @ W, columns interleaved), `gate_up_bias [E, 2I]`,
`down_weight [E, I, H]`, `down_bias [E, H]`. Keeping HF's orientation and interleaving makes every
checkpoint tensor one whole parameter (load reads expert rows as slices; no permutation on load or
save). The four tensors, in that order, are the module's `ExpertKind` (`mop.models.moe`), which
expert parallelism partitions and ships under these same names; `gpt_oss_experts` is its compute.

Computation (`gpt_oss_experts`): rows sorted by expert (`mop.models.moe.expert_order`), then one
grouped GEMM per projection where `torch._grouped_mm` applies, else one GEMM pair per expert (the
two agree; the tests compare them). Each row's biases are gathered by its expert id, expanded on
the device from the per-expert counts (no host synchronisation, no per-expert host work); on CUDA
the groups are padded with zero rows to CUDA_GROUP_ROWS, whose biases are zero too, so a padding
row's hidden activation is (0 + 1) * 0 * sigmoid(0) = 0 and its output is dropped.
With a `probe` (the chunked expert-parallel backward's, see `mop.models.moe.swiglu_experts`), each
row's fp32 `<probe, h D_e + d_e> = <probe D_e^T, h> + <probe, d_e>`, without the down
projection's forward: its backward for the row weight w is `w * probe D_e^T` into h,
`h^T (w * probe)` into D_e and `sum w * probe` into d_e, the experts' backward for the output
gradient `w * probe`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.moe import ExpertKind, StackedProjection, replayed_selection, row_product
from mop.models.projections import Groups, device_ints
from mop.models.shape import ModelShape

NAMES = ("gate_up_weight", "gate_up_bias", "down_weight", "down_bias")


class GptOssRouter(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.bias = nn.Parameter(torch.empty(cfg.experts))
        self.top_k = cfg.top_k

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None):
        """`x [T, H]` -> (fp32 probabilities [T, E], weights [T, k], expert ids [T, k], own top-k ids
        [T, k]): the softmax of the chosen experts' logits; `forced` (routing replay,
        `mop.models.moe.replayed_selection`) replaces the choice, its logits live."""
        logits = F.linear(x, self.weight, self.bias)
        top, own = torch.topk(logits, self.top_k, dim=-1)
        expert_ids = replayed_selection(own, forced)
        if forced is not None:
            top = logits.gather(-1, expert_ids)
        return F.softmax(logits.float(), dim=-1), F.softmax(top, dim=-1), expert_ids, own


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`[rows, 2I]` interleaved gate/up -> `[rows, I]`, as the reference's `_apply_gate`."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_experts(x_sorted: torch.Tensor, counts: list[int], stacked: tuple[torch.Tensor, ...], alpha: float,
                    limit: float, grouped: bool | None = None, align: int | None = None,
                    probe: torch.Tensor | None = None) -> torch.Tensor:
    """Expert e of `stacked` (`NAMES`' tensors) on its contiguous run of `counts[e]` rows of
    `x_sorted`, or with `probe` each row's `<probe, expert(x)>` (module docstring): `gpt_oss_projected`
    of the plain stacked tensors."""
    return gpt_oss_projected(x_sorted, counts, KIND.tensors(stacked), alpha, limit, grouped, align, probe)


def gpt_oss_projected(x_sorted: torch.Tensor, counts: list[int], tensors: dict, alpha: float, limit: float,
                      grouped: bool | None = None, align: int | None = None,
                      probe: torch.Tensor | None = None) -> torch.Tensor:
    """`gpt_oss_experts` on `tensors` by name: the two weights as projections (`mop.models.projections`),
    the biases as stacked tensors. `grouped` (None: where it applies) and `align` (None: the
    device's) as `mop.models.moe.swiglu_projected`."""
    gate_up, down = tensors["gate_up_weight"], tensors["down_weight"]
    groups = Groups.of(x_sorted, counts, (gate_up, down), grouped, align)
    expert_of = _expert_of_rows(counts, x_sorted.device)
    gate_up_rows = gate_up(groups.pad(x_sorted), groups) + groups.pad(tensors["gate_up_bias"][expert_of])
    hidden = clamped_swiglu(gate_up_rows, alpha, limit)
    down_bias = tensors["down_bias"][expert_of]
    if probe is None:
        return groups.unpad(down(hidden, groups)) + down_bias
    return groups.unpad(row_product(down.back(groups.pad(probe), groups), hidden)) + row_product(probe, down_bias)


def _expert_of_rows(counts: list[int], device) -> torch.Tensor:
    """Each sorted row's expert index, `repeat_interleave(arange(E), counts)`, built on the device."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device), device_ints(counts, device),
                                   output_size=sum(counts))


KIND = ExpertKind(NAMES, gpt_oss_projected, (StackedProjection("gate_up_weight", transposed=True),
                                             StackedProjection("down_weight", transposed=True)))


class GptOssExperts(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        experts, hidden, inter = cfg.experts, cfg.hidden, cfg.expert_intermediate
        self.num_experts = experts
        self.gate_up_weight = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_weight = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = cfg.options.swiglu_alpha, cfg.options.swiglu_limit
        self.kind = KIND.with_options(alpha=self.alpha, limit=self.limit)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                grouped: bool | None = None, align: int | None = None) -> torch.Tensor:
        """`x [T, H]`, `expert_ids, weights [T, k]` -> `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`.
        `grouped` (None: where it applies) and `align` (None: the device's) as `swiglu_projected`."""
        return self.kind.forward(self, x, expert_ids, weights, grouped=grouped, align=align)
