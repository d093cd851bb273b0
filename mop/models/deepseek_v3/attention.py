"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): low-rank q and kv, a decoupled RoPE key.

Per token x:
    q      = q_b(q_a_norm(q_a(x)))  (or q_proj(x) without a q LoRA)      -> [heads, nope + rope]
    latent, k_rope = split(kv_a(x), [kv_lora_rank, rope])                 k_rope: one head, shared
    k_nope, v = split(kv_b(kv_a_norm(latent)), [nope, v_head_dim])        per head
    q_rope, k_rope turned by RoPE (YaRN: `mop.models.rope`); interleaved checkpoints deinterleaved
    k = [k_nope, k_rope] (k_rope broadcast to every head), q = [q_nope, q_rope]
    out = o_proj(attention(q, k, v)), scores scaled by (nope + rope)^-1/2 x mscale(factor,
          mscale_all_dim)^2 when YaRN sets `mscale_all_dim` (DeepSeek applies YaRN twice: to cos/sin
          by the attention factor, and to the softmax scale).
The q_a/kv_a norms use eps 1e-6 whatever `model.norm_eps` is, as the reference does.

The sequence-mixing core is the shared `AttentionCore` (its scale set), so Ulysses, packed
documents and both kernels serve MLA unchanged: q of width nope + rope, k handed over as its
per-head `k_nope` and the one shared rotary part (`shared_key`), which the core appends to every
head (so Ulysses sends `heads x nope + rope` key elements per token, not `heads x (nope + rope)`:
for DeepSeek-V3 16448 instead of 24576), v of its own width (the flash path pads v to q's width;
`mop.models.documents`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mop.models.attention import AttentionCore
from mop.models.documents import Documents
from mop.models.layers import RMSNorm
from mop.models.rope import apply_rope, deinterleave, rope_cos_sin, yarn_mscale
from mop.models.shape import ModelShape
from mop.models.spec import AttentionSpec, core_saved_bytes, norm_saved_bytes

LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelShape) -> float:
    options = cfg.options
    scale = cfg.head_dim ** -0.5
    if options.yarn and options.yarn_mscale_all_dim:
        scale *= yarn_mscale(options.yarn_factor, options.yarn_mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        o = cfg.options
        self.heads, self.rope_dim, self.v_dim = cfg.heads, o.qk_rope_head_dim, o.v_head_dim
        self.nope_dim = cfg.head_dim - o.qk_rope_head_dim
        self.kv_lora_rank, self.interleaved = o.kv_lora_rank, o.rope_interleave
        if o.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden, o.q_lora_rank, bias=o.attention_bias)
            self.q_a_layernorm = RMSNorm(o.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(o.q_lora_rank, cfg.heads * cfg.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden, o.kv_lora_rank + o.qk_rope_head_dim, bias=o.attention_bias)
        self.kv_a_layernorm = RMSNorm(o.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(o.kv_lora_rank, cfg.heads * (self.nope_dim + o.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.heads * o.v_head_dim, cfg.hidden, bias=o.attention_bias)
        self.rope_options, self.rope_theta = o, cfg.rope_theta
        self.core = AttentionCore(softmax_scale(cfg))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, documents: Documents | None):
        batch, seq, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(batch, seq, self.heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, self.heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        inv_freq = self.rope_options.inv_freq(self.rope_dim, self.rope_theta, position_ids.device)
        cos, sin = rope_cos_sin(position_ids, inv_freq, x.dtype, self.rope_options.attention_factor())
        q_rope, k_rope = (self._rotate(t, cos, sin) for t in (q_rope, k_rope.view(batch, seq, 1, self.rope_dim)))
        q = torch.cat((q_nope, q_rope), dim=-1)
        out = self.core(q, k_nope, v, documents, shared_key=k_rope)
        return self.o_proj(out.reshape(batch, seq, self.heads * self.v_dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.interleaved else x, cos, sin)


@dataclass(frozen=True)
class MLASpec(AttentionSpec):
    """`MultiHeadLatentAttention`'s shape (kv_heads = heads: every head has its own k and v)."""

    hidden: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int
    bias: bool

    @classmethod
    def of(cls, cfg: ModelShape) -> "MLASpec":
        o = cfg.options
        return cls(cfg.heads, cfg.heads, cfg.head_dim, o.v_head_dim, cfg.hidden, o.q_lora_rank, o.kv_lora_rank,
                   o.qk_rope_head_dim, o.attention_bias)

    @property
    def nope_dim(self) -> int:
        return self.qk_head_dim - self.rope_dim

    @property
    def k_width(self) -> int:
        """The key as the core receives it: per-head non-rotary parts and the one shared rotary part
        (which Ulysses sends to each of the D ranks once: D x rope, not counted here)."""
        return self.heads * self.nope_dim + self.rope_dim

    @property
    def matmul_parameters(self) -> int:
        q = self.hidden * self.q_lora_rank + self.q_lora_rank * self.q_width if self.q_lora_rank else (
            self.hidden * self.q_width)
        kv = self.hidden * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank * self.heads * (
            self.nope_dim + self.v_head_dim)
        return q + kv + self.out_width * self.hidden

    @property
    def parameters(self) -> int:
        norms = self.q_lora_rank + self.kv_lora_rank
        biases = self.q_lora_rank + self.kv_lora_rank + self.rope_dim + self.hidden if self.bias else 0
        return self.matmul_parameters + norms + biases

    def saved_bytes_per_token(self, act: int, head_chunks: int) -> int:
        # the latents and their norms, kv_b's output, the rope tables and the two rotated parts
        q_latent = self.q_lora_rank * act + norm_saved_bytes(self.q_lora_rank, act) if self.q_lora_rank else 0
        kv_latent = (self.kv_lora_rank + self.rope_dim) * act + norm_saved_bytes(self.kv_lora_rank, act)
        kv_b = self.heads * (self.nope_dim + self.v_head_dim) * act
        rope = 2 * self.rope_dim * act + (self.heads + 1) * self.rope_dim * act
        return q_latent + kv_latent + kv_b + rope + core_saved_bytes(self, act, head_chunks)

