"""GLM-4.5's own hyper-parameters (`[model.options]`): its attention's biases and partial rotary, and
DeepSeek-V3's routing (`GroupRoutingOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.moe import GroupRoutingOptions
from mop.models.shape import ModelShape


@dataclass(frozen=True)
class Options(GroupRoutingOptions):
    attention_bias: bool = False
    """Biases on the q, k and v projections (o has none)."""
    partial_rotary_factor: float = 0.5
    """The share of each head's dims RoPE turns (the first ones)."""

    def validate(self, model: ModelShape) -> list[tuple[str, str]]:
        problems = self.routing_problems(model)
        if not 0 < self.partial_rotary_factor <= 1:
            problems.append(("partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor}"))
        return problems
