"""Mixture-of-Experts feed-forward: softmax top-k router, stacked SwiGLU experts, shared expert.

Routing: `probs = softmax(x W_r^T)` in fp32, the top-k experts per token, their probabilities
optionally renormalised to sum to one. Expert e computes `down_e(silu(gate_e x) * up_e x)`; a
token's output is the routing-weighted sum over its k experts (plus the shared expert, if any).

Experts are stored stacked along the expert dimension, `w_gate_up [E, 2I, H]` (gate rows first,
then up rows) and `w_down [E, H, I]`, the layout of Hugging Face transformers v5, so that an
expert partition is a slice along E and one GEMM per expert reads contiguous memory.

`Experts.forward` is the seam expert parallelism replaces: it receives the tokens of this rank
with their routing decisions and returns their combined expert outputs. What expert parallelism
needs of an experts module is its `ExpertKind` (`kind`): the names of its stacked parameters
(dim 0 the expert) and the function computing the experts on rows sorted by expert; a family with
other experts (gpt_oss's biased ones) gives its own kind, and model code holds no collectives.

The layer also returns `RouterStats`, the per-sequence sums the load-balancing loss is built
from (see `load_balancing_loss`); keeping sums rather than means is what lets a parallel layout
reduce them over exactly the tokens of a sequence and reproduce the single-device loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.layers import SwiGLU
from mop.models.shape import ModelShape


@dataclass
class RouterStats:
    """Per-sequence router sums, accumulated over the MoE layers of a forward pass.

    `assignments[b, e]`: token-expert assignments of row b to expert e (top-k picks, no grad).
    `prob_sum[b, e]`: sum over row b's tokens of the router probability of expert e (has grad).
    `rows[b]`: token-layer pairs that contributed (tokens of row b x MoE layers).
    """

    assignments: torch.Tensor
    prob_sum: torch.Tensor
    rows: torch.Tensor

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.assignments + other.assignments, self.prob_sum + other.prob_sum, self.rows + other.rows)


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """Switch-style loss `E * sum_e f_e P_e` per sequence, summed over the sequences of `stats`.

    f_e = assignments / rows and P_e = prob_sum / rows, pooled over all MoE layers of a sequence:
    for one sequence this is exactly Hugging Face's `load_balancing_loss_func`. The caller divides
    the sum by the global number of sequences, so the loss is a per-sequence mean whatever the
    micro-batching or layout.
    """
    experts = stats.assignments.shape[-1]
    rows = stats.rows.unsqueeze(-1)
    per_sequence = experts * ((stats.assignments / rows) * (stats.prob_sum / rows)).sum(-1)
    return per_sequence.sum()


class Router(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor):
        """`x [T, H]` -> (fp32 probabilities [T, E], top-k weights [T, k], top-k expert ids [T, k])."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, expert_ids


@dataclass(frozen=True)
class GroupRoutingOptions:
    """The options of `GroupLimitedSigmoidRouter`, shared by the families that route with it (their
    `Options` derive from this class)."""

    groups: int = 1
    """`n_group`: the experts split into this many equal groups for group-limited routing."""
    groups_per_token: int = 1
    """`topk_group`: a token's experts come from its best this many groups."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: after each optimizer step every MoE layer's score-correction
    bias moves by this rate x sign(mean load - load), from the step's global expert counts
    (DeepSeek-V3 pre-trains with 0.001); 0 keeps it frozen, the fine-tuning default."""

    def routing_problems(self, model: ModelShape) -> list[tuple[str, str]]:
        problems = []
        if self.groups < 1 or model.experts % self.groups:
            problems.append(("groups", f"must be >= 1 and divide model.experts={model.experts}, got {self.groups}"))
        elif not 1 <= self.groups_per_token <= self.groups:
            problems.append(("groups_per_token", f"must be in [1, model.options.groups={self.groups}]"))
        elif model.top_k > self.groups_per_token * (model.experts // self.groups):
            problems.append(("groups_per_token", f"{self.groups_per_token} groups of {model.experts // self.groups} "
                                                 f"experts hold fewer than model.top_k={model.top_k}"))
        if self.router_bias_update_rate < 0:
            problems.append(("router_bias_update_rate", f"must be >= 0 (0 freezes the bias), got "
                                                        f"{self.router_bias_update_rate}"))
        return problems

    def router(self, model: ModelShape) -> "GroupLimitedSigmoidRouter":
        return GroupLimitedSigmoidRouter(model, self.groups, self.groups_per_token, self.routed_scaling_factor,
                                         self.router_bias_update_rate)


class GroupLimitedSigmoidRouter(nn.Module):
    """DeepSeek-V3 / GLM-4.5 routing, in fp32: `scores = sigmoid(x W_r^T)`; for selection only, the
    score-correction bias (a buffer: auxiliary-loss-free balancing moves it, the gradient never does)
    is added; the experts are split into `groups` equal groups, a group scores the sum of its two best
    corrected scores, and the top-k experts are chosen among the `groups_per_token` best groups. The
    weights are the chosen experts' uncorrected scores, optionally renormalised (+1e-20, as the
    reference), times `scaling` (`routed_scaling_factor`, applied in both cases).

    The first output, what the load-balancing statistics sum, is the scores normalised over the
    experts (DeepSeek-V3's sequence-wise balance loss uses these)."""

    def __init__(self, cfg: ModelShape, groups: int, groups_per_token: int, scaling: float,
                 bias_update_rate: float = 0.0):
        super().__init__()
        self.bias_update_rate = bias_update_rate  # read by MoETransformer.update_router_biases
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.register_buffer("score_correction_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.groups, self.groups_per_token, self.scaling = groups, groups_per_token, scaling

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.score_correction_bias.zero_()

    def forward(self, x: torch.Tensor):
        """`x [T, H]` -> (normalised fp32 scores [T, E], top-k weights [T, k], top-k expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.score_correction_bias
        per_group = choice.shape[-1] // self.groups
        group_scores = choice.unflatten(-1, (self.groups, per_group)).topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(self.groups_per_token, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=-1), float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores / scores.sum(dim=-1, keepdim=True), weights * self.scaling, expert_ids


def expert_order(expert_ids: torch.Tensor, experts: int):
    """Sort token-expert assignments by expert: (order into the flat [T*k] list, counts per expert)."""
    flat = expert_ids.reshape(-1)
    # Counted by index_add_, not bincount: bincount reads its input's maximum back to the host (a
    # device synchronisation on CUDA in every layer).
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def grouped_gemm_applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes fp32/bf16/fp16 with 16-byte-aligned rows (H and I multiples of 16 bytes)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w_gate_up.dtype != x.dtype:
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w_down.shape[-1] % align == 0


# Rows per expert group on CUDA: 16 bytes of bf16 rows (and of fp32 ones), whatever dtype
# autocast computes the grouped GEMM in.
CUDA_GROUP_ROWS = 8


def device_ints(values: list[int], device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host-built integer tensor on `device`, without waiting for the device.

    `torch.tensor(values, device=cuda)` copies with `non_blocking=False`, which synchronises the
    stream: every kernel queued before it must finish. A non-blocking copy from pageable memory
    is staged by CUDA before it returns, so `values` may go away at once."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def row_ranges(starts: list[int], lengths: list[int], device) -> torch.Tensor:
    """`cat([arange(s, s + n) for s, n in zip(starts, lengths)])`, expanded on `device` from the
    per-range integers (no per-row host work, no wait for the device)."""
    total = sum(lengths)
    start, length = device_ints(starts, device), device_ints(lengths, device)
    shift = torch.repeat_interleave(start - (length.cumsum(0) - length), length, output_size=total)
    return shift + torch.arange(total, device=device)


def swiglu_experts(x_sorted: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   grouped: bool | None = None, align: int | None = None, probe: torch.Tensor | None = None):
    """Apply expert e to its contiguous run of `counts[e]` rows of `x_sorted`.

    One grouped GEMM per projection where `torch._grouped_mm` applies (`grouped=None` decides),
    otherwise one GEMM pair per expert; the two give identical results (tested bit for bit).
    Groups are padded with zero rows to a multiple of `align` rows (default on CUDA:
    CUDA_GROUP_ROWS, whose weight-gradient grouped GEMM, grouped along the rows, needs group
    offsets aligned to 16 bytes; none on the CPU): the padding rows are zeros, so the real rows' outputs and the
    gradients are unchanged up to the kernel's summation order.

    With `probe` (rows like `x_sorted`, `[rows, H]`), the per-row fp32 product `<probe, expert(x)>`
    instead of the outputs, computed as `<probe W_down, hidden>` without the down projection's
    forward. Its backward, given each row's output weight w, is the experts' backward for the output
    gradient `w * probe`: `w * probe W_down` into the hidden activations, `sum w * probe^T hidden`
    into W_down. So a backward that has the rows and their output gradients (unweighted, `probe`)
    gets both the experts' gradients and the routing weights' gradient (the products) after
    re-running the gate and up projections alone, not the down projection.
    """
    if grouped is None:
        grouped = grouped_gemm_applies(x_sorted, w_gate_up, w_down)
    if not grouped:
        return _expert_loop(x_sorted, counts, w_gate_up, w_down, probe)
    align = align or (CUDA_GROUP_ROWS if x_sorted.is_cuda else 1)
    if align == 1:
        return _grouped_swiglu(x_sorted, counts, w_gate_up, w_down, probe)
    padded = [-(-count // align) * align for count in counts]
    starts = [sum(padded[:e]) for e in range(len(padded))]
    rows = row_ranges(starts, counts, x_sorted.device)  # where each real row sits among the padded ones

    def pad(t):
        return None if t is None else t.new_zeros((sum(padded), t.shape[1])).index_copy(0, rows, t)

    return _grouped_swiglu(pad(x_sorted), padded, w_gate_up, w_down, pad(probe))[rows]


def row_product(probe_down: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Per row `<probe W_down, hidden>` (= `<probe, hidden W_down^T>`), summed in fp32."""
    return (probe_down * hidden).sum(-1, dtype=torch.float32)


def _grouped_swiglu(x_sorted, counts: list[int], w_gate_up, w_down, probe=None) -> torch.Tensor:
    offsets = device_ints(counts, x_sorted.device).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x_sorted, w_gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    if probe is None:
        return torch._grouped_mm(hidden, w_down.transpose(1, 2), offs=offsets)
    return row_product(torch._grouped_mm(probe, w_down, offs=offsets), hidden)


def _expert_loop(x_sorted, counts: list[int], w_gate_up, w_down, probe=None) -> torch.Tensor:
    outputs = []
    probes = probe.split(counts) if probe is not None else [None] * len(counts)
    # unbind once: its backward stacks the per-expert gradients in one tensor, where indexing
    # w[expert] per expert would allocate a full-size zero gradient for every expert.
    for rows, rows_probe, gate_up_weight, down_weight in zip(x_sorted.split(counts), probes, w_gate_up.unbind(0),
                                                            w_down.unbind(0)):
        if rows.shape[0] == 0:
            continue
        gate, up = F.linear(rows, gate_up_weight).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        outputs.append(F.linear(hidden, down_weight) if rows_probe is None
                       else row_product(rows_probe @ down_weight, hidden))
    if outputs:
        return torch.cat(outputs)
    # With no rows at all, an empty slice of the input keeps the output on the autograd graph.
    return x_sorted[:0, : w_down.shape[1]] if probe is None else x_sorted[:0, 0].float()


@dataclass(frozen=True)
class ExpertKind:
    """An experts module as expert parallelism sees it (`mop.parallel.llep`), with no collectives.

    `names`: its stacked parameters, in order, each with the expert on dim 0: a partition is a
    slice of each along dim 0, and shipping expert e ships index e of each.
    `compute(x_sorted, counts, stacked, probe=None)`: the experts whose stacked tensors are
    `stacked` (one per name, E' experts each) applied to rows sorted by expert, `counts[e]` rows
    for expert e (a host list); with `probe` (`[rows, H]`), each row's fp32 `<probe, expert(x)>`
    instead, whose backward for per-row weights w is the experts' backward for the output gradient
    `w * probe` (see `swiglu_experts`; the chunked path's backward relies on it).
    """

    names: tuple[str, ...]
    compute: Callable[..., torch.Tensor]

    def stacked(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        """`module`'s stacked parameters in `names`' order."""
        return tuple(getattr(module, name) for name in self.names)


def stacked_swiglu(x_sorted: torch.Tensor, counts: list[int], stacked: tuple[torch.Tensor, ...],
                   probe: torch.Tensor | None = None) -> torch.Tensor:
    """`swiglu_experts` on the stacked `(w_gate_up, w_down)`: the shared experts' `ExpertKind.compute`."""
    w_gate_up, w_down = stacked
    return swiglu_experts(x_sorted, counts, w_gate_up, w_down, probe=probe)


SWIGLU_KIND = ExpertKind(("w_gate_up", "w_down"), stacked_swiglu)


class Experts(nn.Module):
    kind = SWIGLU_KIND

    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.num_experts = cfg.experts
        self.w_gate_up = nn.Parameter(torch.empty(cfg.experts, 2 * cfg.expert_intermediate, cfg.hidden))
        self.w_down = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.expert_intermediate))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`x [T, H]`, `expert_ids, weights [T, k]` -> `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`."""
        top_k = expert_ids.shape[-1]
        order, counts = expert_order(expert_ids, self.num_experts)
        token_of = order // top_k
        y = swiglu_experts(x[token_of], counts.tolist(), self.w_gate_up, self.w_down)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))


class MoE(nn.Module):
    """An MoE layer: the family's router and routed experts (handed over by its block: `Router` and
    `Experts` by default) and an optional shared expert."""

    def __init__(self, cfg: ModelShape, router=Router, experts=Experts):
        super().__init__()
        self.router = router(cfg)
        self.experts = experts(cfg)
        self.shared = SwiGLU(cfg.hidden, cfg.shared_expert_intermediate) if cfg.shared_expert_intermediate else None

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None):
        """`x [B, S, H]` -> (output [B, S, H], RouterStats for the B rows over the tokens not flagged
        in `padding [B, S]`)."""
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        probs, weights, expert_ids = self.router(flat)
        out = self.experts(flat, expert_ids, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(batch, seq, hidden), self._stats(probs, expert_ids, batch, padding)

    @staticmethod
    def _stats(probs: torch.Tensor, expert_ids: torch.Tensor, batch: int, padding: torch.Tensor | None) -> RouterStats:
        experts = probs.shape[-1]
        ids = expert_ids.view(batch, -1)
        probs = probs.view(batch, -1, experts)
        # [B, S]: each token's k picks and its probabilities count when it is real (not padding)
        real = probs.new_ones(probs.shape[:2]) if padding is None else (~padding).to(probs.dtype)
        per_pick = real.repeat_interleave(ids.shape[1] // real.shape[1], dim=1)
        picks = probs.new_zeros(batch, experts).scatter_add_(1, ids, per_pick)
        return RouterStats(picks, (probs * real.unsqueeze(-1)).sum(1), real.sum(1).float())
