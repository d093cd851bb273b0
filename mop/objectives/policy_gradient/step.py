"""One micro-batch's share of a policy-gradient step on packed rollouts, and the step's counts.

Per micro-batch (every rank alike, so the collectives line up):
1. with `rl.beta > 0`, the reference's per-token log-probs: under LoRA the frozen base with the
   adapters off (`mop.models.lora.adapters_disabled`), under no_grad, the same routes replayed; else
   those of the starting weights computed before the first step (`reference_logps`,
   `mop.objectives.policy_gradient.reference`);
2. the policy's forward (`MoETransformer.policy_terms`): each token's log-prob of its label and
   entropy, the MoE layers replaying the routes (`Replay`: the rollouts' own, R3; or those the
   batch's first step ran, R2, on its later steps);
3. the old log-probs `o_t`, those of the weights before the batch's first update: on its first step
   the live ones detached (the forward of those very weights, so TRL's separate no-grad pass would
   give the same values; the ratio is 1, its gradient the policy gradient's), kept per micro-batch
   (`BatchCache`, on the device: 4 bytes per token, and R2's routes 2 x moe_layers x top_k, int16)
   for the batch's later steps (`rl.updates_per_batch`), released as its last step reads them. A
   run resumed inside a batch's updates has lost them: it takes the resumed weights' and says so once;
4. the correction, the per-token losses and their aggregation weights from the step's global counts
   (`mop.objectives.policy_gradient.loss`), and the load-balancing term as in supervised training.

What needs a rollout's every token (the sequence-level ratio and correction) goes through
`RolloutSums`: a `[slots]` float64 sum per rollout of the micro-batch (slot `row x rollouts_max +
rollout_ids`), summed over a sequence group by the model's `response_sums` seam (each of its D ranks
then holds every sum and uses it on its own tokens only: no 1/D share, unlike DPO's per-pair losses).

Counts (summed over every rank before the first forward): the step's generated tokens N (its targets,
which the loop counts) and, the objective's own (`local_counts`), its rollouts S (their
`rollout_starts`), its tokens with a known sampling log-prob, its rollouts with a known reward and its
sequences holding rollouts (`sequence_starts`: the load-balancing loss's mean is over them).
Records (`step_record`): TRL's names, each a mean over the whole step (TRL's are means over each
process's micro-batch, or of per-process means: equal on one process and micro-batch),
the rewards' mean and unbiased std over the step's rollouts, and per MoE layer the share of replayed
tokens whose own top-k differs from the replayed one (`routing/replay_mismatch/layer_<i>`, `<i>` the MoE
layer's index: model layer `dense_layers + i`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from mop.config import RlConfig
from mop.models.lora import adapters_disabled
from mop.models.transformer import IGNORE_INDEX, MoETransformer
from mop.objectives.policy_gradient.loss import (
    PolicyLoss,
    aggregation_weights,
    correction,
    record_sums,
    token_losses,
)

COUNTS = ("rollouts", "sampled_tokens", "rewarded_rollouts", "sequences")
SUMS_ONLY = ("reward_", "zero_std", "replay_")  # parts the record turns into other values


def policy_loss(rl: RlConfig) -> PolicyLoss:
    """The loss's coefficients from the [rl] settings (0 meaning "none" where TRL has None)."""
    return PolicyLoss(rl.loss_type, rl.epsilon, rl.epsilon_high or None, rl.delta or None, rl.beta,
                      rl.kl_bias_correction, rl.max_completion_length, rl.importance_sampling_level)


def local_counts(batches: list[dict]) -> list[int]:
    """This rank's `COUNTS` of the step (module docstring); its generated tokens are the step's targets,
    which the loop counts itself (`StepCounts.targets`)."""
    rollouts = sum(int(b["rollout_starts"].sum()) for b in batches)
    sampled = sum(int(((b["labels"] != IGNORE_INDEX) & ~b["sampling_logps"].isnan()).sum()) for b in batches)
    rewarded = sum(int((b["rollout_starts"] & ~b["rewards"].isnan()).sum()) for b in batches)
    sequences = sum(int(b["sequence_starts"].sum()) for b in batches)  # the load-balancing loss's count
    return [rollouts, sampled, rewarded, sequences]


def step_counts(targets: int, own) -> dict[str, int]:
    """The step's counts by name: the objective's own (`COUNTS`, in `local_counts`' order) and its
    generated tokens N, the step's targets."""
    return {**dict(zip(COUNTS, (int(c) for c in own))), "tokens": int(targets)}


class RolloutSums:
    """Each token's rollout's sum of per-token values over the micro-batch's rows and, under sequence
    parallelism, its sequence group (module docstring); a `loss.RolloutSum`."""

    def __init__(self, model: MoETransformer, rollout_ids: torch.Tensor, rollouts_max: int):
        rows = rollout_ids.shape[0]
        base = torch.arange(rows, device=rollout_ids.device).unsqueeze(1) * rollouts_max
        self.valid = (rollout_ids >= 0).flatten()
        self.slot = torch.where(rollout_ids >= 0, base + rollout_ids, 0).flatten()
        self.slots, self.seam = rows * rollouts_max, model.response_sums

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros(self.slots, dtype=torch.float64, device=values.device)
        sums = sums.index_add(0, self.slot, torch.where(self.valid, values, 0).double())
        return self.seam(sums.unsqueeze(0))[0][self.slot].to(values.dtype)


@dataclass
class BatchCache:
    """What a batch's first step keeps for its later ones, per micro-batch in the step's order
    (module docstring); `resumed_inside` says a run resumed inside a batch's updates (once, where
    `says`: the main rank)."""

    says: bool
    old: list[torch.Tensor] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    resumed_inside: bool = False


class PolicyGradientLoss:
    """A micro-batch's loss on packed rollouts (module docstring): (loss, its float64 parts `parts`,
    the policy's expert counts). `replay`: "rollout" (R3), "old" (R2) or "off"; `update`: which of
    its batch's updates the step is; `cache`: the batch's `BatchCache`."""

    def __init__(self, model: MoETransformer, rl: RlConfig, counts: dict[str, int], sequences: int,
                 rollouts_max: int, replay: str, moe_layers: int, update: int, cache: BatchCache):
        self.model, self.rl, self.loss = model, rl, policy_loss(rl)
        self.counts, self.sequences, self.rollouts_max, self.replay = counts, sequences, rollouts_max, replay
        self.moe_layers, self.update, self.cache, self.index = moe_layers, update, cache, 0
        self.parts = part_names(self.loss, rl, replay != "off", moe_layers)
        self.last = update == rl.updates_per_batch - 1
        if update == 0:
            cache.old.clear()
            cache.routes.clear()

    def terms(self, batch: dict, routes: torch.Tensor | None, record: bool = False):
        return self.model.policy_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                       batch["document_ids"], batch.get("padding"), routes, record)

    def routes(self, batch: dict) -> torch.Tensor | None:
        """The micro-batch's replayed routes: the rollouts' (R3), the batch's first step's (R2)."""
        if self.replay == "rollout":
            return batch["routes"]
        if self.replay == "old" and self.update > 0 and self.index < len(self.cache.routes):
            return self.cache.routes[self.index]
        return None

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        routes = self.routes(batch)
        reference = None
        if self.rl.reference == "base":  # the rollouts' routes (R3), never R2's: one reference for all updates
            with torch.no_grad(), adapters_disabled(self.model):
                reference = self.terms(batch, routes if self.replay == "rollout" else None).logps.flatten()
        elif self.rl.reference == "precomputed":
            reference = batch["reference_logps"].flatten()
        first = self.update == 0 or self.index >= len(self.cache.old)
        terms = self.terms(batch, routes, record=self.replay == "old" and first and not self.last)
        generated = (batch["labels"] != IGNORE_INDEX).flatten()
        logps = terms.logps.flatten()
        old = self._old(logps, terms.routes, first)
        sums = RolloutSums(self.model, batch["rollout_ids"], self.rollouts_max)
        sampling = batch["sampling_logps"].flatten()
        corrections = None
        if self.rl.correction != "none":
            corrections = correction(old, sampling, sums, self.rl.correction, self.rl.correction_min or None,
                                     self.rl.correction_max or None)
        rollout_tokens = batch["rollout_tokens"].flatten()
        advantages = batch["advantages"].flatten()
        losses, ratio, kl = token_losses(self.loss, logps, old, advantages, reference, corrections, sums,
                                         rollout_tokens)
        weights = aggregation_weights(self.loss, rollout_tokens, self.counts["rollouts"], self.counts["tokens"])
        policy = (torch.where(generated, losses, 0) * weights).sum()
        aux = self.model.aux_objective(terms.router, self.sequences)
        loss = policy + aux
        parts = self._parts(batch, generated, ratio, advantages, kl, terms, old, sampling, corrections,
                            rollout_tokens)
        head = torch.stack([policy.detach().double(), torch.as_tensor(aux, device=parts.device).detach().double()])
        if self.last and not first:  # the batch's last update: what its first step kept is read for the last time
            self.cache.old[self.index] = None
            if self.index < len(self.cache.routes):
                self.cache.routes[self.index] = None
        self.index += 1
        return loss, torch.cat([head, parts]), terms.expert_stats

    def _old(self, logps: torch.Tensor, routes: torch.Tensor | None, first: bool) -> torch.Tensor:
        """The old log-probs (module docstring): the live ones on the batch's first step, kept with its
        routes (R2) for the later steps."""
        if not first:
            return self.cache.old[self.index]
        if self.update > 0 and not self.cache.resumed_inside:
            self.cache.resumed_inside = True
            if self.cache.says:
                print(f"mop: warning: resumed inside a batch's {self.rl.updates_per_batch} updates: its old "
                      "log-probs are the resumed weights', not those before the batch's first update",
                      file=sys.stderr, flush=True)
        old = logps.detach()
        if not self.last:  # a later update of the batch reads them
            self.cache.old.append(old)
            if routes is not None:
                self.cache.routes.append(routes)
        return old

    def _parts(self, batch, generated, ratio, advantages, kl, terms, old, sampling, corrections,
               rollout_tokens) -> torch.Tensor:
        """The records' sums (`part_names` past the first two) of this micro-batch."""
        counts = self.counts
        token_weights = generated.double() / max(counts["tokens"], 1)
        rollout_weights = torch.where(generated, 1.0 / (rollout_tokens.double().clamp(min=1)
                                                        * max(counts["rollouts"], 1)), 0.0)
        kl = None if kl is None else torch.where(generated, kl, 0)
        sums = record_sums(self.loss, ratio.detach(), advantages, kl, terms.entropy.flatten(), token_weights,
                           rollout_weights)
        known = generated & ~sampling.isnan()
        difference = torch.where(known, (old - sampling).abs(), 0).double().sum() / max(counts["sampled_tokens"], 1)
        ratio_weights = rollout_weights if self.rl.correction.startswith("sequence") else token_weights
        starts = batch["rollout_starts"].flatten() & ~batch["rewards"].flatten().isnan()
        rewards = torch.where(starts, batch["rewards"].flatten(), 0).double()
        zero_std = (batch["zero_std"].flatten() & batch["rollout_starts"].flatten()).double().sum()
        sampled = [difference, (corrections.double() * ratio_weights).sum()] if corrections is not None else []
        values = [*sums.values(), *sampled, rewards.sum(), rewards.square().sum(), zero_std]
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=old.device) for v in values])
        if self.replay == "off":
            return values
        # R2's first step replays nothing: no token counts
        replayed = terms.replay.flatten() if terms.replay is not None else values.new_zeros(2 * self.moe_layers)
        return torch.cat([values, replayed])


def part_names(loss: PolicyLoss, rl: RlConfig, replay: bool, moe_layers: int) -> list[str]:
    """The names of a micro-batch's parts, in order: the losses, TRL's mean records, the sums the
    reward and replay records are made of."""
    records = ["entropy", *(["kl"] if loss.beta else [])]
    records += (["cispo_clip_ratio"] if loss.loss_type == "cispo" else
                ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"])
    sampling = ["sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"]
    sums = [*(sampling if rl.correction != "none" else []), "reward_sum", "reward_square_sum", "zero_std_rollouts"]
    replayed = [f"replay_{what}/{layer}" for layer in range(moe_layers) for what in ("mismatched", "tokens")]
    return ["policy_loss", "aux_loss", *records, *sums, *(replayed if replay else [])]


def step_record(parts: list[float], names: list[str], counts: dict[str, int], moe_layers: int) -> dict:
    """The step's record from its parts summed over forwards and ranks (module docstring)."""
    named = dict(zip(names, parts))
    record = {"loss": named["policy_loss"] + named["aux_loss"], "policy_loss": named["policy_loss"],
              "aux_loss": named["aux_loss"]}
    record.update({name: value for name, value in named.items()
                   if name not in record and not name.startswith(SUMS_ONLY)})
    rewarded, rollouts = counts["rewarded_rollouts"], counts["rollouts"]
    if rewarded:
        mean = named["reward_sum"] / rewarded
        spread = (named["reward_square_sum"] - rewarded * mean * mean) / (rewarded - 1) if rewarded > 1 else math.nan
        record.update({"reward": mean, "reward_std": math.sqrt(max(spread, 0.0)) if rewarded > 1 else math.nan,
                       "frac_reward_zero_std": named["zero_std_rollouts"] / max(rollouts, 1)})
    if any(k.startswith("replay_") for k in named):
        mismatched = [named[f"replay_mismatched/{layer}"] for layer in range(moe_layers)]
        replayed = [named[f"replay_tokens/{layer}"] for layer in range(moe_layers)]
        record["routing/replay_mismatch"] = sum(mismatched) / max(sum(replayed), 1)
        record.update({f"routing/replay_mismatch/layer_{layer}": m / max(t, 1)
                       for layer, (m, t) in enumerate(zip(mismatched, replayed))})
    record.update({"rollouts": rollouts, "completion_tokens": counts["tokens"], "sequences": counts["sequences"]})
    return record
