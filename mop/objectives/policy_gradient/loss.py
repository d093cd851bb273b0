"""GRPO-family losses from per-token log-probs, every aggregation a per-token weight counted over
the whole step (so one objective in every layout and micro-batching).

Per completion token t of rollout i, with the live policy's log-prob `p_t`, the log-prob before
this batch's updates `o_t` (a no-grad pass; `p_t` itself, detached, on the first update), the
rollout's advantage `A_i` (or a token's own) and TRL 1.16's `GRPOTrainer._compute_loss` at
`importance_sampling_level` "token" or "sequence" (GSPO):
- ratio `r_t = exp(p_t - o_t)`, or at the sequence level the rollout's `exp(mean_t (p_t - o_t))` on
  each of its tokens;
- "grpo", "bnpo", "dr_grpo", "dapo": `l_t = -min(min(r_t, delta) A, clip(r_t, 1 - eps, 1 + eps_high) A)`
  (`delta`: two-sided clipping, none by default);
- "cispo": `l_t = -sg(min(r_t, eps_high)) A p_t`;
- the train-inference correction `c_t` (`correction`: the old pass's log-probs against the engine's
  sampling ones, per token or summed per rollout, truncated to `[cap_min, cap_max]` or masked to 0
  outside it) multiplies `l_t`;
- with `beta > 0` the k3 KL to the reference log-prob `q_t`, `k_t = exp(q_t - p_t) - (q_t - p_t) - 1`,
  times `r_t` (`kl_bias_correction`, TRL's `use_bias_correction_kl`), adds `beta k_t`.
The step's loss is `sum_t w_t l_t` over its completion tokens (`aggregation_weights`):
- "grpo": `w_t = 1 / (n_i S)`: each rollout's token mean, then the mean over the step's S rollouts;
- "bnpo", "dapo", "cispo": `w_t = 1 / N`: the mean over the step's N completion tokens;
- "dr_grpo": `w_t = 1 / (S L)`, L = `max_completion_length`.
n_i, S and N are counted over every rank and micro-batch before the first forward. TRL counts
"bnpo" per micro-batch and process (a mean of means), the others as here; on one micro-batch of one
process every loss type equals TRL's.

Every function works on flat `[T]` token tensors (the completion's tokens of any rows, in any
order), reads nothing back to the host and keeps `p_t`'s graph only where TRL's loss does. What needs
all of a rollout's tokens (the sequence-level ratio and correction) takes a `RolloutSum`: each
token's rollout's sum of a per-token tensor: the objective's step gives one that sums over the
micro-batch's rows and, under sequence parallelism, its sequence group
(`mop.objectives.policy_gradient.step.RolloutSums`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"]
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
RolloutSum = Callable[[torch.Tensor], torch.Tensor]
"""`[T]` per-token values -> `[T]`: each token's rollout's sum of them (with gradient)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A loss type and its coefficients (TRL's names and defaults)."""

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    """The ratio's lower clip `1 - epsilon`."""
    epsilon_high: float | None = None
    """The ratio's upper clip `1 + epsilon_high` (CISPO: the ratio's cap); None: `epsilon`."""
    delta: float | None = None
    """Two-sided clipping: the unclipped ratio capped at `delta`; None: no cap."""
    beta: float = 0.0
    """The k3 KL's coefficient (0: no KL, no reference)."""
    kl_bias_correction: bool = True
    """Weigh the KL by the ratio (TRL's `use_bias_correction_kl`)."""
    max_completion_length: int = 512
    """Dr. GRPO's constant normaliser L."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The ratio per token, or per rollout from its tokens' mean log-ratio (GSPO: with "grpo")."""

    def __post_init__(self):
        if self.loss_type not in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo"):
            raise ValueError(f"loss_type {self.loss_type!r} is none of grpo, dr_grpo, dapo, bnpo, cispo")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def aggregation_weights(loss: PolicyLoss, rollout_tokens: torch.Tensor, step_rollouts: int,
                        step_tokens: int) -> torch.Tensor:
    """Each completion token's weight `w_t` (module docstring); `rollout_tokens`: `[T]`, the
    completion tokens of each token's rollout (n_i); `step_rollouts`, `step_tokens`: S and N."""
    if loss.loss_type == "grpo":
        return 1.0 / (rollout_tokens.clamp(min=1) * max(step_rollouts, 1))
    if loss.loss_type == "dr_grpo":
        scale = 1.0 / (max(step_rollouts, 1) * loss.max_completion_length)
    else:
        scale = 1.0 / max(step_tokens, 1)
    return torch.full_like(rollout_tokens, scale, dtype=torch.float32)


def correction(old: torch.Tensor, sampling: torch.Tensor, rollout_sum: RolloutSum | None, mode: CorrectionMode,
               cap_min: float | None, cap_max: float | None) -> torch.Tensor:
    """The train-inference correction `c_t` `[T]` of the old pass's log-probs `old` against the
    engine's `sampling` ones (NaN: unknown, no correction): per token, or per rollout from the
    rollout's summed differences (`rollout_sum`); truncated to `[cap_min, cap_max]`, or 0 outside
    it. Computed without a graph, before the update."""
    with torch.no_grad():
        difference = torch.nan_to_num(old.float() - sampling.float(), nan=0.0)
        if mode.startswith("sequence"):
            difference = rollout_sum(difference)
        ratio = difference.exp()
        if mode.endswith("truncate"):
            return ratio.clamp(min=cap_min, max=cap_max)
        low = -float("inf") if cap_min is None else cap_min
        high = float("inf") if cap_max is None else cap_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def token_losses(loss: PolicyLoss, logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                 reference: torch.Tensor | None = None, corrections: torch.Tensor | None = None,
                 rollout_sum: RolloutSum | None = None,
                 rollout_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`l_t` `[T]` (module docstring), the ratio `r_t` and the k3 KL `k_t` (None without `beta`);
    at the sequence level `rollout_sum` and `rollout_tokens` (its n_i) give each rollout's mean
    log-ratio."""
    log_ratio = logps - old
    if loss.importance_sampling_level == "sequence":
        log_ratio = rollout_sum(log_ratio) / rollout_tokens.clamp(min=1)
    ratio = log_ratio.exp()
    if loss.loss_type == "cispo":
        losses = -ratio.clamp(max=loss.high).detach() * advantages * logps
    else:
        clipped = ratio.clamp(1 - loss.epsilon, 1 + loss.high)
        unclipped = ratio if loss.delta is None else ratio.clamp(max=loss.delta)
        losses = -torch.min(unclipped * advantages, clipped * advantages)
    if corrections is not None:
        losses = losses * corrections
    kl = None
    if loss.beta:
        gap = reference - logps
        kl = gap.exp() - gap - 1
        if loss.kl_bias_correction:
            kl = kl * ratio
        losses = losses + loss.beta * kl
    return losses, ratio, kl


@torch.no_grad()
def record_sums(loss: PolicyLoss, ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor | None,
                entropy: torch.Tensor, token_weights: torch.Tensor,
                rollout_weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's mean records as sums that, summed over forwards and ranks, are the step's means: kl and
    entropy over its completion tokens (`token_weights`: 1 / their count on each, 0 on other tokens)
    and, for the clipped losses, clip_ratio/low_mean, high_mean, region_mean (CISPO:
    cispo_clip_ratio), over tokens or, at the sequence level, over rollouts (`rollout_weights`: each
    token's 1 / (n_i S), 0 on other tokens)."""
    token_weights = token_weights.double()
    sums = {"entropy": (entropy.double() * token_weights).sum()}
    if kl is not None:
        sums["kl"] = (kl.double() * token_weights).sum()
    weights = rollout_weights.double() if loss.importance_sampling_level == "sequence" else token_weights

    def mean(indicator: torch.Tensor) -> torch.Tensor:
        return (indicator.double() * weights).sum()

    if loss.loss_type == "cispo":
        sums["cispo_clip_ratio"] = mean((ratio > loss.high) & (advantages > 0))
        return sums
    low = (ratio < 1 - loss.epsilon) & (advantages < 0)
    high = (ratio > 1 + loss.high) & (advantages > 0)
    sums.update({"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                 "clip_ratio/region_mean": mean(low | high)})
    return sums
