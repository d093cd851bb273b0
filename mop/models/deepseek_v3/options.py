"""DeepSeek-V3's own hyper-parameters (`[model.options]`): its latent attention's widths, YaRN
(`YarnOptions`) and its routing (`GroupRoutingOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.moe import GroupRoutingOptions
from mop.models.rope import YarnOptions
from mop.models.shape import ModelShape


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

    def validate(self, model: ModelShape) -> list[tuple[str, str]]:
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
