"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases (none on
o), partial rotary (the first `partial_rotary_factor` of each head, half-split within them),
optional q/k RMSNorm before RoPE; DeepSeek-V3's routing (fp32 sigmoid scores, a score-correction
bias for selection only, group-limited top-k, `routed_scaling_factor`) with shared experts and
dense first layers. Everything but its options and its attention's spec is a shared module."""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.attention import Attention, GQASpec
from mop.models.config import ModelConfig
from mop.models.family import Family
from mop.models.glm4_moe import hf
from mop.models.moe import GroupRoutingOptions
from mop.models.spec import ModelSpec


@dataclass(frozen=True)
class Options(GroupRoutingOptions):
    attention_bias: bool = False
    """Biases on the q, k and v projections (o has none)."""
    partial_rotary_factor: float = 0.5
    """The share of each head's dims RoPE turns (the first ones)."""

    def validate(self, model: ModelConfig) -> list[tuple[str, str]]:
        problems = self.routing_problems(model)
        if not 0 < self.partial_rotary_factor <= 1:
            problems.append(("partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor}"))
        return problems


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.options.partial_rotary_factor)


FAMILY = Family(
    "glm4_moe",
    attention=lambda cfg, layer: Attention(cfg, qkv_bias=cfg.options.attention_bias, rotary_dim=rotary_dim(cfg)),
    spec=lambda cfg: ModelSpec(cfg, GQASpec.of(cfg, qkv_bias=cfg.options.attention_bias)), hf=hf,
    router=lambda cfg: cfg.options.router(cfg),
    options=Options)
