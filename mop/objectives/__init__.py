"""Training objectives as plug-ins: what one step of `mop train` optimises (`mop.objectives.base`
says what one provides, `README.md` here how to add one).

`OBJECTIVES` names each, one line per objective; `objective_for(config)` is the one that trains the
run's `data.format`. The loop (`mop.train`) and the settings (`mop.settle`) reach an objective only
through this registry.
"""

from __future__ import annotations

from mop.config import Config
from mop.objectives.base import Objective, StepCounts
from mop.objectives.next_token.objective import NextToken
from mop.objectives.preference.objective import Preference

OBJECTIVES: dict[str, type[Objective]] = {
    "next_token": NextToken,
    "preference": Preference,
}

__all__ = ["OBJECTIVES", "Objective", "StepCounts", "objective_for"]


def objective_for(config: Config) -> type[Objective]:
    """The objective whose `formats` hold `data.format` (the config's checks make one exist)."""
    return next(objective for objective in OBJECTIVES.values() if config.data.format in objective.formats)
