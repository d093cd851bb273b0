"""Grouped-query self-attention with optional q/k RMSNorm, RoPE and packed-document masking.

`Attention` does the projections, the q/k norms and RoPE on whatever tokens it is given (with
their global positions), and delegates the sequence-mixing step to `self.core`, an
`AttentionCore`. Sequence parallelism replaces only the core: the core is the one place that
needs every token of a sequence, so it is the one place a parallel layout has to touch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.config import ModelConfig
from mop.models.layers import RMSNorm, apply_rope, rope_cos_sin


def attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean `[B, 1, S, S]` mask: causal, and never across a packed-document boundary."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return (causal & same_document).unsqueeze(1)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v over full sequences, via `scaled_dot_product_attention`.

    Inputs are `[B, S, heads, head_dim]` (keys/values with `kv_heads` heads); `document_ids`
    `[B, S]` or None for one document per row. Output has the queries' shape.
    """

    def forward(self, q, k, v, document_ids: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if document_ids is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask = attention_mask(document_ids)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor | None):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, document_ids)
        return self.o_proj(out.reshape(batch, seq, self.heads * self.head_dim))
