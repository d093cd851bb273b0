"""Grouped-query self-attention with optional q/k RMSNorm, biases, RoPE (default, YaRN, partial),
per-head sinks and packed documents.

`Attention` does the projections, the q/k norms and RoPE on whatever tokens it is given (with
their global positions), and delegates the sequence-mixing step to `self.core`, an
`AttentionCore`. Sequence parallelism replaces only the core: the core is the one place that
needs every token of a sequence, so it is the one place a parallel layout has to touch.

`GQASpec` is this attention's shape facts (`mop.models.spec`), for the families that use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mop.models.documents import Documents, document_attention
from mop.models.layers import RMSNorm
from mop.models.rope import YarnOptions, apply_rope, rope_cos_sin
from mop.models.shape import ModelShape
from mop.models.spec import AttentionSpec, core_saved_bytes, norm_saved_bytes


class AttentionCore(nn.Module):
    """Causal attention within each packed document (`mop.models.documents.document_attention`).

    Inputs are `[B, S, heads, head_dim]` (keys/values with `kv_heads` heads, values of their own
    width) and the micro-batch's `Documents` (None: one document per row). Output has the queries'
    shape at the values' width. `scale` multiplies the scores (None: 1/sqrt(head_dim)).
    `shared_key [B, S, 1, r]`: a key part every head shares (latent attention's rotary key),
    appended to each head's key here, after the sequence-parallel exchange sent it once.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v, documents: Documents | None, shared_key: torch.Tensor | None = None) -> torch.Tensor:
        if shared_key is not None:
            k = torch.cat((k, shared_key.expand(-1, -1, k.shape[2], -1)), dim=-1)
        return document_attention(q, k, v, documents, self.scale)


class Attention(nn.Module):
    def __init__(self, cfg: ModelShape, qkv_bias: bool = False, o_bias: bool = False, rotary_dim: int | None = None,
                 rope: YarnOptions | None = None, sinks: bool = False, core: AttentionCore | None = None):
        """`qkv_bias`, `o_bias`: biases on the q, k and v projections, on o; `rotary_dim`: RoPE turns
        only the first `rotary_dim` dims of each head (partial rotary; default all of them); `rope`:
        YaRN settings (None: the default RoPE); `sinks`: a learned sink logit per query head, which
        the core takes after the documents (gpt-oss's `SinkWindowCore`); `core`: the sequence-mixing
        core (default `AttentionCore`)."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta, self.rotary_dim, self.rope = cfg.rope_theta, rotary_dim or cfg.head_dim, rope or YarnOptions()
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(cfg.heads)) if sinks else None
        self.core = core or AttentionCore()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, documents: Documents | None):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # one pair of tables for q and k: autograd saves them once per layer, not twice
        inv_freq = self.rope.inv_freq(self.rotary_dim, self.rope_theta, position_ids.device)
        cos, sin = rope_cos_sin(position_ids, inv_freq, q.dtype, self.rope.attention_factor())
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out = self.core(q, k, v, documents, *(() if self.sinks is None else (self.sinks,)))
        return self.o_proj(out.reshape(batch, seq, self.heads * self.head_dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        turned, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((apply_rope(turned, cos, sin), kept), dim=-1)


@dataclass(frozen=True)
class GQASpec(AttentionSpec):
    """`Attention`'s shape: q/k/v/o projections, optional q/k RMSNorm over head_dim, biases, sinks."""

    hidden: int
    qk_norm: bool
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False

    @classmethod
    def of(cls, cfg: ModelShape, qkv_bias: bool = False, o_bias: bool = False, sinks: bool = False) -> "GQASpec":
        return cls(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.head_dim, cfg.hidden, cfg.qk_norm, qkv_bias, o_bias,
                   sinks)

    @property
    def parameters(self) -> int:
        norms = 2 * self.qk_head_dim if self.qk_norm else 0
        biases = ((self.q_width + self.k_width + self.v_width) if self.qkv_bias else 0) + (
            self.hidden if self.o_bias else 0)
        return self.matmul_parameters + norms + biases + (self.heads if self.sinks else 0)

    @property
    def matmul_parameters(self) -> int:
        return self.hidden * (self.q_width + self.k_width + self.v_width + self.out_width)

    def saved_bytes_per_token(self, act: int, head_chunks: int) -> int:
        # q/k norms save per head row; RoPE its cos/sin tables
        qk = (self.heads + self.kv_heads) * norm_saved_bytes(self.qk_head_dim, act) if self.qk_norm else 0
        return qk + 2 * self.qk_head_dim * act + core_saved_bytes(self, act, head_chunks)
