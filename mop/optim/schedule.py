"""The learning-rate schedule: linear warm-up, then cosine decay to `optim.min_lr_ratio` of the peak."""

from __future__ import annotations

import math

from mop.config import Config, ConfigError


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to `min_ratio` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def learning_rate(config: Config, step: int) -> float:
    o = config.optim
    return o.lr * lr_factor(step, o.warmup_steps, config.train.steps, o.min_lr_ratio)


def check_settings(config: Config, world: int) -> None:
    if not 0 <= config.optim.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {config.optim.min_lr_ratio}")
