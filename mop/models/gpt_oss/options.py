"""gpt-oss's own hyper-parameters (`[model.options]`): its sliding window, biases, clamped SwiGLU and
YaRN (`YarnOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.rope import YarnOptions
from mop.models.shape import ModelShape


@dataclass(frozen=True)
class Options(YarnOptions):
    yarn_truncate: bool = False
    """Round the ramp's correction dims outwards (`truncate`); gpt-oss does not."""
    sliding_window: int = 128
    """Keys a query of a sliding-window block (the even ones) sees, itself included (`sliding_window`)."""
    attention_bias: bool = True
    """Biases on the q, k, v and o projections (`attention_bias`)."""
    swiglu_limit: float = 7.0
    """The experts clamp the gate above and the up projection on both sides at this value."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' gate, `gate * sigmoid(alpha * gate)`."""

    def validate(self, model: ModelShape) -> list[tuple[str, str]]:
        problems = self.yarn_problems()
        if self.sliding_window < 1:
            problems.append(("sliding_window", f"must be >= 1, got {self.sliding_window}"))
        for key in ("swiglu_limit", "swiglu_alpha"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        if not model.norm_topk_prob:
            problems.append(("norm_topk_prob", "gpt_oss's router always softmaxes the top-k logits: set "
                                               "model.norm_topk_prob = true"))
        return problems
