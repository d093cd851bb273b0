"""DPO's losses from per-response log-prob sums (`mop.models.transformer.PreferenceTerms`).

For pair i with chosen c and rejected r, the policy's summed target log-probs `pi(c), pi(r)` and
the reference's `ref(c), ref(r)`, the log-ratios are `dc = pi(c) - ref(c)`, `dr = pi(r) - ref(r)`:
- sigmoid (DPO): `-(1 - e) log sig(beta (dc - dr)) - e log sig(-beta (dc - dr))`, e the label
  smoothing (conservative DPO; 0 is TRL 1.16's "sigmoid");
- ipo: `(dc / nc - dr / nr - 1 / (2 beta))^2`, n a response's target count (TRL's IPO);
- nll (RPO's alpha): `-sum pi(c) / chosen targets`, the chosen responses' mean token NLL over the step.

Normalisation: every term is a sum over the step's pairs (or chosen targets) divided by their
global count, known before the first forward, so any layout and micro-batching gives the same
step objective. Under sequence parallelism the D ranks of a group each hold every response's sums
(`response_sums.copies`), so each takes 1/D of them. A slot no pair fills has no targets and
counts nowhere.

Records (TRL's names, means over the step's pairs): rewards/chosen = beta dc, rewards/rejected =
beta dr, rewards/accuracies = [beta dc > beta dr], rewards/margins = beta (dc - dr), logps/chosen,
logps/rejected = pi(c), pi(r).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mop.config import DpoConfig

RECORDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class StepTotals:
    """A step's global counts, summed over every rank before its first forward."""

    pairs: int
    chosen_targets: int
    sequences: int


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor,
                dpo: DpoConfig) -> torch.Tensor:
    """The per-pair loss `[K]` from `[K, 2]` (chosen, rejected) sums and target counts."""
    ratios = policy - reference
    if dpo.loss == "ipo":
        ratios = ratios / targets.clamp(min=1)
        return (ratios[:, 0] - ratios[:, 1] - 1 / (2 * dpo.beta)).square()
    logits = dpo.beta * (ratios[:, 0] - ratios[:, 1])
    e = dpo.label_smoothing
    return -(1 - e) * F.logsigmoid(logits) - (e * F.logsigmoid(-logits) if e else 0)


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor, totals: StepTotals,
                    dpo: DpoConfig, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This forward's shares of the step's DPO loss and of its chosen NLL (RPO), over its filled slots."""
    filled = (targets > 0).all(-1)
    losses = torch.where(filled, pair_losses(policy, reference, targets, dpo), 0)
    nll = -torch.where(filled, policy[:, 0], 0).sum()
    return losses.sum() / (max(totals.pairs, 1) * copies), nll / (max(totals.chosen_targets, 1) * copies)


@torch.no_grad()
def record_sums(policy: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor, beta: float,
                scale: float) -> torch.Tensor:
    """`RECORDS`' sums over this forward's filled slots times `scale` (float64 `[6]`): summed over the
    step's forwards and ranks with scale = 1 / (pairs x copies), they are the step's means."""
    filled = (targets > 0).all(-1, keepdim=True)  # masked, not indexed: no host sync
    policy, reference = policy.double() * filled, reference.double() * filled
    rewards = beta * (policy - reference)
    wins = (rewards[:, 0] > rewards[:, 1]) & filled[:, 0]
    return torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(), wins.double().sum(),
                        (rewards[:, 0] - rewards[:, 1]).sum(), policy[:, 0].sum(), policy[:, 1].sum()]) * scale
