"""What settling a run gives: the frozen `ResolvedConfig` every part of a run reads, and the record
of how its layout was fitted to its memory (`FitRecord`)."""

from __future__ import annotations

import dataclasses

from mop.config import Config


@dataclasses.dataclass(frozen=True)
class FitRecord:
    """How `mop.settle.fit` fitted a run's automatic settings to its memory budget (the start line and
    config.json)."""

    budget_bytes: int
    budget_source: str
    searched: tuple[str, ...]
    """The settings that were automatic."""
    layout: str
    """The chosen layout in a few words (`mop.cost.candidates.describe`)."""
    kept_default: bool
    """True when the plain layout fits and was kept without a search."""
    predicted_peak_bytes: int
    """The memory model's device peak for one rank."""
    predicted_host_bytes: int
    """Its host bytes for one rank."""
    predicted_need_bytes: int
    """What counts against the budget: the device peak (plus the host bytes on the CPU, one memory)."""
    predicted_moment: str
    predicted_tokens_per_s: float
    """The roofline's tokens/s per rank (nominal on the CPU: for comparing layouts)."""
    considered: int
    binding: str
    """Why nothing faster was chosen (`mop.cost.candidates.binding`)."""


@dataclasses.dataclass(frozen=True)
class ResolvedConfig(Config):
    """Settings with every automatic value decided and every check passed, for `world` ranks."""

    world: int = 0
    """The ranks the settings were resolved for."""
    local_world: int = 0
    """The ranks of the smallest node, which the automatic degrees divide."""
    fit: FitRecord | None = None
    """How the automatic settings were fitted to train.memory_budget (`mop.settle.fit`); None: no fit."""
