"""What a training objective provides (`Objective`), and the step's global counts it is given.

The loop (`mop.train.train_step`) knows no objective: per step it
1. sums over every rank, in one all-reduce, the step's targets (non-ignored labels), the model's
   attended keys, tokens and padding, and the objective's own counts (`local_counts`);
2. runs forward and backward of each of this rank's micro-batches with the objective's micro-batch
   loss (`micro_batch_loss(counts)`: a callable from a batch to the loss, its float64 parts and the
   expert counts), and sums the parts over every rank in one all-reduce;
3. writes the objective's record of the step (`record(parts, counts)`: at least "loss") beside its
   own (targets, tokens, model FLOPs, memory, ...).
Every term of the loss is a sum over the step divided by a global count known before the first
forward, so any layout and micro-batching optimise the same objective. An objective may train each
global batch for several consecutive steps (`updates_per_batch`: PPO-style epochs over one batch of
rollouts); the loop then serves the batch that often and numbers the updates (`StepCounts.update`).

Before step 0 the objective may prepare what it needs (`prepare`: DPO's precomputed reference
log-probs); what it returns is recorded in every checkpoint (`TrainingRun.reference`). Its settings
are decided and checked with the others (`decide`, `check_settings`: `mop.settle`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mop.build import TrainingRun
from mop.config import Config

MicroBatchLoss = Callable[[dict], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""A micro-batch's loss (the share of the step's objective it adds), its float64 parts (the
record's terms, summed over forwards and ranks) and its expert statistics (`LossTerms.expert_stats`;
None: none)."""


@dataclass(frozen=True)
class StepCounts:
    """A step's global counts, summed over every rank before its first forward."""

    targets: int
    """Its non-ignored labels."""
    sequences: int
    """Its sequences (`train.global_batch`)."""
    own: tuple[float, ...] = ()
    """The objective's own counts (`Objective.local_counts`), in its order."""
    update: int = 0
    """Which of its batch's `Objective.updates_per_batch` updates the step is (0: the first)."""


class Objective(ABC):
    """One training objective of a run (module docstring); `mop/objectives/README.md` says what a
    new one provides. The defaults are those of an objective with no settings, counts or preparation
    of its own."""

    formats: tuple[str, ...] = ()
    """The `data.format` values whose rows it trains (each format has one objective)."""
    sections: tuple[str, ...] = ()
    """The config sections of its own settings (`[dpo]`), the only ones its `decide` may change."""

    @staticmethod
    def decide(config: Config) -> Config:
        """Its automatic settings (in its `sections`) decided: every objective's, for every run, so
        config.json shows them."""
        return config

    @staticmethod
    def check_settings(config: Config, world: int) -> None:
        """Its settings' checks (every objective's, for every run: each checks only its own runs)."""

    def __init__(self, run: TrainingRun):
        self.run = run

    def prepare(self, run_dir: Path, meta: dict | None) -> dict | None:
        """What it needs before the first step; `meta`: the checkpoint resumed (None: a fresh start).
        Returns what checkpoints record of it (None: nothing)."""
        return None

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps each global batch is trained for (the loop serves a batch this many
        consecutive steps; `StepCounts.update` says which one a step is)."""
        return 1

    def local_counts(self, batches: list[dict]) -> list[float]:
        """This rank's counts of the step that the loss divides by, beyond its targets (`StepCounts.own`)."""
        return []

    @abstractmethod
    def micro_batch_loss(self, counts: StepCounts) -> MicroBatchLoss:
        """The loss of one micro-batch of the step of `counts` (`MicroBatchLoss`)."""

    @abstractmethod
    def record(self, parts: list[float], counts: StepCounts) -> dict:
        """The step's losses from its parts summed over forwards and ranks: "loss" and its terms."""

    @abstractmethod
    def describe(self) -> str:
        """The start line's account of the data it trains on."""

    def warnings(self) -> list[str]:
        """Lines to warn with at the start (its data's oddities)."""
        return []

    def recorded(self, config: Config) -> Config:
        """The run's settings as config.json records them: with what it decided from the data (its
        `sections` only), where `decide` could not."""
        return config
