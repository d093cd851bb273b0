"""Training objectives as plug-ins: what one step of `mop train` optimises (`mop.objectives.base`
says what one provides, `README.md` here how to add one).

`OBJECTIVES` names each, one line per objective; `objective_for(run)` is the run's, the one that
trains its `data.format`. The loop (`mop.train`) and the settings (`mop.settle`) reach an objective
only through this registry.
"""

from __future__ import annotations

from mop.build import TrainingRun
from mop.objectives.base import Objective, StepCounts
from mop.objectives.next_token.objective import NextToken
from mop.objectives.policy_gradient.objective import PolicyGradient
from mop.objectives.preference.objective import Preference

OBJECTIVES: dict[str, type[Objective]] = {
    "next_token": NextToken,
    "preference": Preference,
    "policy_gradient": PolicyGradient,
}

__all__ = ["OBJECTIVES", "Objective", "StepCounts", "objective_for"]


def objective_for(run: TrainingRun) -> Objective:
    """The run's objective: the one whose `formats` hold its `data.format` (the settings' checks make
    one exist)."""
    kind = next(objective for objective in OBJECTIVES.values() if run.config.data.format in objective.formats)
    return kind(run)
