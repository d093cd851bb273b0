"""Small building blocks shared by the attention and MoE layers: RMSNorm, SwiGLU (RoPE: rope.py).

RMSNorm computes in fp32 whatever the activation dtype, as Hugging Face's Qwen3-MoE and
Mixtral do, so that checkpoints converted from those models give the same numbers. It is one
autograd function that saves its input and the fp32 inverse rms per row and recomputes the
normalised product in its backward: autograd's own graph of the same arithmetic would also keep
the fp32 product (and the fp32 copy of a low-precision input), 4-8 bytes per element more, on
every norm of every block (at 1M tokens per sequence the largest activation the trainer can shed).

Compiling these elementwise bodies was measured and not built (issue 50). `torch.compile` (inductor's
fused C++ loops) of RMSNorm's forward and backward, RoPE (`rope.apply_rope`) and the experts'
`silu(gate) * up` made each 1.6-3x faster alone on a 2-core Xeon, one thread: RMSNorm over
`[16384, 256]` 53 -> 17 ms forward and backward, RoPE over `[16384, 8, 32]` 64 -> 24 ms, SwiGLU over
`[32768, 512]` 205 -> 127 ms. A whole step of `mop bench context`'s 16K work did not move: medians
16.2 s eager and 16.1 s compiled (two runs of each in turn, steps spread 15-21 s), losses within
1e-4, for about 18 s of compilation in the first step and a C++ compiler needed on every CPU host. Not
measured on a GPU, where inductor would emit Triton kernels instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """`weight * (x32 * rstd).to(x.dtype)`, `rstd = rsqrt(mean(x32^2) + eps)`, saving x and rstd.

    Backward of y = w * n, n = x32 * rstd, over the last dim of width H, with g_n = (g * w) in fp32:
    dL/dx = rstd * g_n - x32 * rstd^3 * sum(g_n * x32) / H, and dL/dw = sum over rows of g * n."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = (x32 * rstd).to(x.dtype)
            grad_weight = (grad * normed).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        grad_normed = (grad * weight).to(x.dtype).float()
        dot = (grad_normed * x32).sum(-1, keepdim=True)
        grad_x = grad_normed * rstd - x32 * (rstd.pow(3) * dot / x.shape[-1])
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def compute_dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """The dtype an op on `tensor` computes in: autocast's where it is on for the tensor's device,
    else the tensor's own."""
    kind = tensor.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else tensor.dtype


class SwiGLU(nn.Module):
    """Dense gated MLP `down(silu(gate(x)) * up(x))`, used for dense blocks and the shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
