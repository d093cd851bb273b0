"""Preference optimisation as a training objective: the plug-in `mop train` steps with under
`data.format = "preference"` (the pieces: `loss`, `step`, `reference`, `settings`)."""

from __future__ import annotations

from pathlib import Path

from mop.data import describe_packed
from mop.objectives.base import Objective, StepCounts
from mop.objectives.preference import reference, settings
from mop.objectives.preference.loss import StepTotals
from mop.objectives.preference.step import PreferenceLoss, local_counts, step_record


class Preference(Objective):
    """DPO and its variants on preference pairs (`[dpo]`)."""

    formats = ("preference",)
    sections = ("dpo",)
    decide = staticmethod(settings.decide)
    check_settings = staticmethod(settings.check_settings)

    def prepare(self, run_dir: Path, meta: dict | None) -> dict | None:
        """The precomputed reference log-probs (`reference.attach`); nothing for the base as reference."""
        if self.run.config.dpo.reference != "precomputed":
            return None
        return reference.attach(self.run, run_dir, meta)

    def local_counts(self, batches: list[dict]) -> list[int]:
        return local_counts(batches)

    def micro_batch_loss(self, counts: StepCounts) -> PreferenceLoss:
        run = self.run
        return PreferenceLoss(run.model, run.config.dpo, self._totals(counts), run.data.dataset.pairs_max)

    def record(self, parts: list[float], counts: StepCounts) -> dict:
        return step_record(parts, self.run.config.dpo.nll_alpha, self._totals(counts))

    @staticmethod
    def _totals(counts: StepCounts) -> StepTotals:
        pairs, chosen_targets = counts.own
        return StepTotals(int(pairs), int(chosen_targets), counts.sequences)

    def describe(self) -> str:
        d, dpo, data = self.run.config.data, self.run.config.dpo, self.run.data
        stats = data.dataset.stats
        return (f"preference pairs, {dpo.loss} beta {dpo.beta}, reference {dpo.reference}, prompt "
                f"{'shared' if d.shared_prompt else 'repeated'}, loss on {d.loss_on} "
                f"({describe_packed(stats, 'pairs', data.stream.num_sequences)}; "
                f"{stats['data_degenerate_pairs']} degenerate)")

    def warnings(self) -> list[str]:
        """Pairs whose chosen and rejected tokens are the same (`data.skip_invalid` drops them)."""
        dataset = self.run.data.dataset
        degenerate = dataset.stats.get("data_degenerate_pairs", 0)
        if not degenerate:
            return []
        where = ", ".join(dataset.corpus.degenerate_examples[:3])
        return [f"{degenerate} preference pair(s) have the same chosen and rejected tokens"
                f"{f' (e.g. {where})' if where else ''}: each adds a constant to the loss, no gradient and a miss to "
                "rewards/accuracies; set data.skip_invalid = true to drop them"]
