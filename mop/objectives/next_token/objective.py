"""Next-token prediction's loss and its place in a step.

A micro-batch adds `ce_sum / targets + aux_coef x aux_sum / sequences` (`MoETransformer.objective`):
the cross-entropy summed over its targets over the step's targets on every rank, and the router's
load-balancing term over the step's sequences; so the step optimises the mean cross-entropy of all
its targets whatever the layout. With multi-token-prediction depths (`mop.models.mtp`) it also adds
`mtp_loss_coef / D x sum_k ce_k / targets_k`, each depth's targets counted over the step's ranks
before its first forward (`local_counts`). The record splits the loss into `ce_loss`, `aux_loss`
and, with MTP, `mtp_loss` (its weighted share) and `mtp_ce` (the depths' mean cross-entropy).
"""

from __future__ import annotations

import torch

from mop.data import describe_packed
from mop.models.transformer import MoETransformer, mtp_targets
from mop.objectives.base import Objective, StepCounts


class NextTokenLoss:
    """A micro-batch's loss (module docstring), its float64 parts (ce, aux; with MTP, its weighted
    share) and expert statistics."""

    PARTS = ("ce_loss", "aux_loss", "mtp_loss")

    def __init__(self, model: MoETransformer, global_targets: int, global_batch: int,
                 mtp_targets: tuple[int, ...] = ()):
        self.model, self.global_targets, self.global_batch = model, global_targets, global_batch
        self.mtp_targets = mtp_targets

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        terms = self.model.loss_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                      batch["document_ids"], batch.get("padding"))
        loss = self.model.objective(terms, self.global_targets, self.global_batch, self.mtp_targets)
        ce = terms.ce_sum.detach().double() / max(self.global_targets, 1)
        if terms.mtp_ce is None:
            return loss, torch.stack([ce, loss.detach().double() - ce]), terms.expert_stats
        mtp = self.model.mtp_objective(terms.mtp_ce.detach(), self.mtp_targets).double()
        return loss, torch.stack([ce, loss.detach().double() - ce - mtp, mtp]), terms.expert_stats


class NextToken(Objective):
    """Next-token prediction on text and conversations."""

    formats = ("text", "chat")

    def local_counts(self, batches: list[dict]) -> list[float]:
        """This rank's targets of each MTP depth (none without MTP: `mop.models.mtp`)."""
        depth = self.run.config.model.trained_mtp_layers
        if not depth:
            return []
        counts = [mtp_targets(b["labels"], b["position_ids"], depth) for b in batches]
        return [sum(column) for column in zip(*counts)]

    def micro_batch_loss(self, counts: StepCounts) -> NextTokenLoss:
        return NextTokenLoss(self.run.model, counts.targets, counts.sequences, tuple(int(n) for n in counts.own))

    def record(self, parts: list[float], counts: StepCounts) -> dict:
        record = {"loss": sum(parts), **dict(zip(NextTokenLoss.PARTS, parts))}
        if len(parts) == 3:
            record["mtp_ce"] = parts[2] / self.run.config.model.mtp_loss_coef
        return record

    def describe(self) -> str:
        d, data = self.run.config.data, self.run.data
        if d.format == "text":
            return f"text ({data.stream.num_sequences} sequences)"
        return (f"chat, loss on {d.loss_on} "
                f"({describe_packed(data.dataset.stats, 'conversations', data.stream.num_sequences)})")
