"""DeepSeek-V3 and Kimi-K2 (`DeepseekV3ForCausalLM`; Kimi-K2 is this architecture with another
config): multi-head latent attention (attention.py) with optional q LoRA, YaRN and interleaved
RoPE; DeepSeek-V3's routing (fp32 sigmoid scores, a score-correction bias for selection only,
group-limited top-k, `routed_scaling_factor`) with shared experts and dense first layers.

`model.head_dim` is the q/k head width, `qk_nope_head_dim + qk_rope_head_dim` (192 for
DeepSeek-V3); `model.kv_heads` equals `model.heads` (latent attention has no grouped heads).
Balancing: DeepSeek-V3 pre-trains with auxiliary-loss-free balancing (the score-correction bias
moved by `model.options.router_bias_update_rate`, 0 = frozen, the fine-tuning default) plus a tiny
sequence-wise balance loss (alpha 1e-4, per layer). HF's model has no auxiliary loss, so imports set
`aux_loss_coef` 0; a nonzero `model.aux_loss_coef` trains mop's per-sequence load-balancing loss on
this router's normalised scores, pooled over the MoE layers as HF's loss is (DeepSeek's is per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.config import ModelConfig
from mop.models.deepseek_v3 import hf
from mop.models.deepseek_v3.attention import MLASpec, MultiHeadLatentAttention
from mop.models.family import Family
from mop.models.moe import GroupRoutingOptions
from mop.models.rope import YarnOptions
from mop.models.spec import ModelSpec


@dataclass(frozen=True)
class Options(GroupRoutingOptions, YarnOptions):
    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (q_a -> norm -> q_b); 0: one plain q projection."""
    kv_lora_rank: int = 64
    """Width of the compressed key/value latent."""
    qk_rope_head_dim: int = 16
    """The rotary part of each q/k head (the rest of `model.head_dim` is not rotated); the key's
    rotary part is one head shared by all."""
    v_head_dim: int = 32
    """Width of one value head."""
    rope_interleave: bool = True
    """The checkpoint's rotary dims are interleaved pairs (DeepSeek-V3's layout)."""
    attention_bias: bool = False
    """Biases on q_a, kv_a and o (the reference's `attention_bias`)."""

    def validate(self, model: ModelConfig) -> list[tuple[str, str]]:
        problems = self.routing_problems(model) + self.yarn_problems()
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= model.head_dim:
            problems.append(("qk_rope_head_dim", f"must be even, >= 2 and below model.head_dim={model.head_dim}, "
                                                 f"got {self.qk_rope_head_dim}"))
        for key in ("kv_lora_rank", "v_head_dim"):
            if getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if self.q_lora_rank < 0:
            problems.append(("q_lora_rank", f"must be >= 0 (0: a plain q projection), got {self.q_lora_rank}"))
        if model.kv_heads != model.heads:
            problems.append(("kv_heads", f"latent attention gives every head its own k and v: set model.kv_heads = "
                                         f"model.heads={model.heads}"))
        return problems


FAMILY = Family("deepseek_v3", attention=lambda cfg, layer: MultiHeadLatentAttention(cfg), spec=lambda cfg: ModelSpec(cfg, MLASpec.of(cfg)),
                hf=hf, router=lambda cfg: cfg.options.router(cfg), options=Options)
