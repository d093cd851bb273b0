"""One micro-batch's share of a DPO step's objective, and the step's counts.

Per micro-batch (every rank alike, so the collectives line up):
1. the reference's per-response sums: with `dpo.reference = "base"` (LoRA) a forward of the frozen
   base with the adapters off (`mop.models.lora.adapters_disabled`) under no_grad, in the run's own
   layout and collectives; with "precomputed" the sums stored with the data (`reference_logps`,
   `mop.objectives.preference.reference`), summed in the policy forward's one collective;
2. the policy's forward (`MoETransformer.preference_terms`) and the objective `dpo + nll_alpha x
   nll + aux` (`mop.objectives.preference.loss`; the load-balancing term as in supervised training, over the
   packed rows' tokens, the prompt once).

The reference forward's expert counts never reach auxiliary-loss-free balancing (the run refuses
that with a base reference: the base's router biases would move under it).
"""

from __future__ import annotations

import torch

from mop.config import DpoConfig
from mop.models.lora import adapters_disabled
from mop.models.transformer import IGNORE_INDEX, MoETransformer
from mop.objectives.preference.loss import RECORDS, StepTotals, preference_loss, record_sums

PARTS = ("dpo_loss", "nll_loss", "aux_loss", *RECORDS)


def local_counts(batches: list[dict]) -> list[int]:
    """This rank's pairs (their first chosen token, `pair_starts`) and chosen targets, to be summed
    over the ranks into `StepTotals`."""
    pairs = sum(int(b["pair_starts"].sum()) for b in batches)
    chosen = sum(int(((b["labels"] != IGNORE_INDEX) & (b["response_ids"] >= 0) & (b["response_ids"] % 2 == 0)).sum())
                 for b in batches)
    return [pairs, chosen]


class PreferenceLoss:
    """A micro-batch's loss for preference pairs: (loss, its float64 parts `PARTS`, the
    policy's expert counts) of one micro-batch."""

    def __init__(self, model: MoETransformer, dpo: DpoConfig, totals: StepTotals, pairs_max: int):
        self.model, self.dpo, self.totals, self.pairs_max = model, dpo, totals, pairs_max

    def terms(self, batch: dict, reference_logps=None):
        return self.model.preference_terms(batch["input_ids"], batch["labels"], batch["response_ids"], self.pairs_max,
                                           batch["position_ids"], batch["document_ids"], batch.get("padding"),
                                           batch.get("prefix_lengths"), reference_logps)

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        reference = None
        if self.dpo.reference == "base":
            with torch.no_grad(), adapters_disabled(self.model):
                reference = self.terms(batch).logps
        terms = self.terms(batch, batch.get("reference_logps"))
        reference = terms.reference if reference is None else reference
        copies = self.model.response_sums.copies
        dpo, nll = preference_loss(terms.logps, reference, terms.targets, self.totals, self.dpo, copies)
        aux = self.model.aux_objective(terms.router, self.totals.sequences)
        loss = dpo + self.dpo.nll_alpha * nll + aux
        records = record_sums(terms.logps.detach(), reference, terms.targets, self.dpo.beta,
                              1 / (max(self.totals.pairs, 1) * copies))
        parts = torch.cat([torch.stack([torch.as_tensor(p, device=records.device).detach().double()
                                        for p in (dpo, nll, aux)]), records])
        return loss, parts, terms.expert_stats


def step_record(parts: list[float], nll_alpha: float, totals: StepTotals) -> dict:
    """The step's record from its parts summed over forwards and ranks."""
    named = dict(zip(PARTS, parts))
    loss = named["dpo_loss"] + nll_alpha * named["nll_loss"] + named["aux_loss"]
    return {"loss": loss, **named, "pairs": totals.pairs}
