"""Settling a run: raw settings in, the one frozen `ResolvedConfig` a run uses out, decided once
where the world and the device are known.

`settle(config, world, local_world, limits)` is the one entry point (`mop train` and its launcher,
torchrun's ranks, the benches, the tests):
1. the plain rules (`rules.resolve`): each feature's decisions from what it reads (a LoRA run's
   model and base format from its base, `adapters`; every objective's own, `mop.objectives`), every
   automatic setting by its plain rule, every check;
2. the memory a rank may use: `train.memory_budget` parsed once, first (`budget.MemoryBudget`: a bad
   value is refused whatever the run), then measured on this machine (`budget.MemoryLimits`; under
   torchrun the caller passes every rank's smallest);
3. the fit (`fit.fit_to_memory`): under "mop", the layout settings left automatic fitted to that memory by the
   cost model (`mop.cost`), recorded in the config's `fit` (`resolved.FitRecord`).
With `fit_memory=False` step 3 is skipped: the plain rules alone, for benches and tests that pin a layout.
Every problem is one `ConfigError` (an impossible layout: `LayoutError`) naming the setting.

Pure rules about one setting's value live with the settings (`mop.config.Config`: the compute and
storage dtypes, micro-batches per step); the cost model below `mop.build` is `mop.cost`.
"""

from __future__ import annotations

from mop.config import Config
from mop.settle.budget import MemoryBudget, MemoryLimits
from mop.settle.fit import automatic_axes, fit_to_memory
from mop.settle.resolved import ResolvedConfig
from mop.settle.rules import resolve

__all__ = ["MemoryBudget", "MemoryLimits", "ResolvedConfig", "settle"]


def settle(config: Config, world: int | None = None, local_world: int | None = None,
           limits: MemoryLimits | None = None, fit_memory: bool = True) -> ResolvedConfig:
    """`config` settled (module docstring) for `world` ranks (None: the ranks mop's launcher starts,
    `parallel.nproc`, all on this node), whose smallest node runs `local_world` (default: all);
    `limits`: the memory a rank may use (None: this machine's `train.memory_budget`); `fit_memory`:
    False keeps the plain rules."""
    budget = MemoryBudget.read(config.train) if limits is None else None
    decided = resolve(config, world, local_world)
    if not fit_memory:
        return decided
    if limits is None:
        limits = budget.limits(decided.local_world)
    return fit_to_memory(decided, automatic_axes(config), limits, config.train.keep_freed_host_memory == "auto")
