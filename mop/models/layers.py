"""Small building blocks shared by the attention and MoE layers: RMSNorm, SwiGLU (RoPE: rope.py).

RMSNorm computes in fp32 whatever the activation dtype, as Hugging Face's Qwen3-MoE and
Mixtral do, so that checkpoints converted from those models give the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
