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
save), and the names differ from the shared `Experts`' `w_gate_up [E, 2I, H]` on purpose: code that
knows only that layout (the expert-parallel layouts) fails by name instead of misreading these.

Computation: tokens sorted by expert (`mop.models.moe.expert_order`), then one grouped GEMM per
projection where `torch._grouped_mm` applies, else one GEMM pair per expert (the two agree; the
tests compare them). Each row's biases are gathered by its expert id (no per-expert host work);
on CUDA the groups are padded with zero rows to CUDA_GROUP_ROWS, whose biases are zero too, so a
padding row's hidden activation is (0 + 1) * 0 * sigmoid(0) = 0 and its output is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.config import ModelConfig
from mop.models.moe import CUDA_GROUP_ROWS, device_ints, expert_order, row_ranges


class GptOssRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.bias = nn.Parameter(torch.empty(cfg.experts))
        self.top_k = cfg.top_k

    def forward(self, x: torch.Tensor):
        """`x [T, H]` -> (fp32 probabilities [T, E], top-k weights [T, k], top-k expert ids [T, k])."""
        logits = F.linear(x, self.weight, self.bias)
        top, expert_ids = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(logits.float(), dim=-1), F.softmax(top, dim=-1), expert_ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`[rows, 2I]` interleaved gate/up -> `[rows, I]`, as the reference's `_apply_gate`."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, hidden, inter = cfg.experts, cfg.hidden, cfg.expert_intermediate
        self.num_experts = experts
        self.gate_up_weight = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_weight = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = cfg.options.swiglu_alpha, cfg.options.swiglu_limit

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                grouped: bool | None = None, align: int | None = None) -> torch.Tensor:
        """`x [T, H]`, `expert_ids, weights [T, k]` -> `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`.
        `grouped` (None: where it applies) and `align` (None: the device's) as `swiglu_experts`."""
        top_k = expert_ids.shape[-1]
        order, counts = expert_order(expert_ids, self.num_experts)
        token_of = order // top_k
        rows = x[token_of]
        expert_of = expert_ids.reshape(-1)[order]
        if grouped is None:
            grouped = self.grouped_gemm_applies(rows)
        y = self._grouped(rows, counts.tolist(), expert_of, align) if grouped else self._loop(rows, counts.tolist())
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))

    def grouped_gemm_applies(self, rows: torch.Tensor) -> bool:
        """`torch._grouped_mm` takes fp32/bf16/fp16 with 16-byte-aligned rows (H and I)."""
        if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16) or self.gate_up_weight.dtype != rows.dtype:
            return False
        align = 16 // rows.element_size()
        return rows.shape[-1] % align == 0 and self.down_weight.shape[1] % align == 0

    def _grouped(self, rows, counts: list[int], expert_of, align: int | None) -> torch.Tensor:
        align = align or (CUDA_GROUP_ROWS if rows.is_cuda else 1)
        padded = [-(-count // align) * align for count in counts]
        where = row_ranges([sum(padded[:e]) for e in range(len(padded))], counts, rows.device) if align > 1 else None

        def pad(t):
            return t if where is None else t.new_zeros((sum(padded), t.shape[1])).index_copy(0, where, t)

        offsets = device_ints(padded, rows.device).cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(pad(rows), self.gate_up_weight, offs=offsets) + pad(self.gate_up_bias[expert_of])
        out = torch._grouped_mm(clamped_swiglu(gate_up, self.alpha, self.limit), self.down_weight, offs=offsets)
        return (out if where is None else out[where]) + self.down_bias[expert_of]

    def _loop(self, rows, counts: list[int]) -> torch.Tensor:
        outputs = []
        # unbind once: its backward stacks the per-expert gradients (see `mop.models.moe._expert_loop`)
        for part, w_in, b_in, w_out, b_out in zip(rows.split(counts), self.gate_up_weight.unbind(0),
                                                  self.gate_up_bias.unbind(0), self.down_weight.unbind(0),
                                                  self.down_bias.unbind(0)):
            if part.shape[0]:
                outputs.append(clamped_swiglu(part @ w_in + b_in, self.alpha, self.limit) @ w_out + b_out)
        # with no rows at all, an empty slice of the input keeps the output on the autograd graph
        return torch.cat(outputs) if outputs else rows[:0]
