"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases (none on
o), partial rotary (the first `partial_rotary_factor` of each head, half-split within them),
optional q/k RMSNorm before RoPE; DeepSeek-V3's routing (fp32 sigmoid scores, a score-correction
bias for selection only, group-limited top-k, `routed_scaling_factor`) with shared experts and
dense first layers. Everything but its options and its attention's spec is a shared module."""

from __future__ import annotations

from mop.models.attention import Attention, GQASpec
from mop.models.family import Family
from mop.models.glm4_moe import hf
from mop.models.glm4_moe.options import Options
from mop.models.shape import ModelShape
from mop.models.spec import ModelSpec


def rotary_dim(cfg: ModelShape) -> int:
    return int(cfg.head_dim * cfg.options.partial_rotary_factor)


FAMILY = Family(
    "glm4_moe",
    attention=lambda cfg, layer: Attention(cfg, qkv_bias=cfg.options.attention_bias, rotary_dim=rotary_dim(cfg)),
    spec=lambda cfg: ModelSpec(cfg, GQASpec.of(cfg, qkv_bias=cfg.options.attention_bias)), hf=hf.MAPPING,
    router=lambda cfg: cfg.options.router(cfg),
    options=Options)
