"""Policy-gradient training on recorded rollouts as a training objective: the plug-in `mop train`
steps with under `data.format = "rollouts"` (the pieces: `loss`, `step`, `settings`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mop.config import ConfigError
from mop.data import describe_packed
from mop.objectives.base import Objective, StepCounts
from mop.objectives.policy_gradient import reference, settings
from mop.objectives.policy_gradient.step import (
    BatchCache,
    PolicyGradientLoss,
    local_counts,
    part_names,
    policy_loss,
    step_counts,
    step_record,
)

REPLAY = {"rollout": "of the rollouts' routes (R3)", "old": "of the batch's first step's routes (R2)", "off": "off"}


class PolicyGradient(Objective):
    """GRPO and its family on recorded rollouts (`[rl]`), with routing replay."""

    formats = ("rollouts",)
    sections = ("rl",)
    decide = staticmethod(settings.decide)
    check_settings = staticmethod(settings.check_settings)

    def __init__(self, run):
        super().__init__(run)
        rl, has_routes = run.config.rl, run.data.dataset.corpus.routes is not None
        if rl.replay == "rollout" and not has_routes:
            raise ConfigError("rl.replay", f"'rollout' replays the rollouts' routed_experts, and none of "
                              f"{run.config.data.source}'s rows has them; record them (vLLM/SGLang: "
                              "--enable-return-routed-experts) or set --rl.replay=auto")
        self.replay = rl.replay if rl.replay != "auto" else (
            "rollout" if has_routes else "old" if rl.updates_per_batch > 1 else "off")
        cfg = run.config.model
        self.moe_layers = cfg.layers - cfg.dense_layers
        self.cache = BatchCache(says=run.runtime.is_main)

    def prepare(self, run_dir: Path, meta: dict | None) -> dict | None:
        """The precomputed reference log-probs of the KL (`reference.attach`); nothing otherwise."""
        if self.run.config.rl.reference != "precomputed":
            return None
        return reference.attach(self.run, run_dir, meta, self.replay == "rollout")

    @property
    def updates_per_batch(self) -> int:
        return self.run.config.rl.updates_per_batch

    def local_counts(self, batches: list[dict]) -> list[int]:
        return local_counts(batches)

    def micro_batch_loss(self, counts: StepCounts) -> PolicyGradientLoss:
        run, named = self.run, self._counts(counts)
        # the aux loss's mean over the sequences holding rollouts: the RL loop's empty ones are not data
        return PolicyGradientLoss(run.model, run.config.rl, named, named["sequences"], run.data.dataset.rollouts_max,
                                  self.replay, self.moe_layers, counts.update, self.cache)

    def record(self, parts: list[float], counts: StepCounts) -> dict:
        names = part_names(policy_loss(self.run.config.rl), self.run.config.rl, self.replay != "off", self.moe_layers)
        return step_record(parts, names, self._counts(counts), self.moe_layers)

    @staticmethod
    def _counts(counts: StepCounts) -> dict[str, int]:
        return step_counts(counts.targets, counts.own)

    def warnings(self) -> list[str]:
        """A correction with no sampling log-probs to correct against; groups of one rollout."""
        correction, corpus, out = self.run.config.rl.correction, self.run.data.dataset.corpus, []
        if correction != "none" and np.isnan(corpus.sampling[corpus.targets]).all():
            out.append(f"the rollouts carry no sampling_logps: rl.correction = '{correction}' corrects nothing (a "
                       "ratio of 1 on every token); record the engine's log-probs, or set rl.correction = 'none'")
        if corpus.lone_groups:
            out.append(f"{len(corpus.lone_groups)} group(s) of the rollouts hold one rollout (the first: "
                       f"group {corpus.lone_groups[0]!r}): its advantage is 0, so it trains nothing but the "
                       "KL, and it counts in frac_reward_zero_std; sample 2 or more rollouts per prompt (TRL refuses "
                       "fewer than 2 generations)")
        return out

    def recorded(self, config):
        """rl.replay as chosen ("auto" decided by whether the rollouts carry routes)."""
        return dataclasses.replace(config, rl=dataclasses.replace(config.rl, replay=self.replay))

    def describe(self) -> str:
        rl, data = self.run.config.rl, self.run.data
        rewarded = not np.isnan(data.dataset.corpus.rewards).all()
        signal = f"advantages from rewards (scaled by {rl.scale_rewards})" if rewarded else "given advantages"
        return (f"rollouts, {rl.loss_type} with {rl.importance_sampling_level}-level ratios, correction "
                f"{rl.correction}, {rl.updates_per_batch} update(s) per batch, routing replay {REPLAY[self.replay]}, "
                f"{signal} "
                f"({describe_packed(data.dataset.stats, 'rollouts', data.stream.num_sequences)})")
