"""Next-token prediction's loss and its place in a step.

A micro-batch adds `ce_sum / targets + aux_coef x aux_sum / sequences` (`MoETransformer.objective`):
the cross-entropy summed over its targets over the step's targets on every rank, and the router's
load-balancing term over the step's sequences; so the step optimises the mean cross-entropy of all
its targets whatever the layout. The record splits the loss into `ce_loss` and `aux_loss`.
"""

from __future__ import annotations

import torch

from mop.data import describe_packed
from mop.models.transformer import MoETransformer
from mop.objectives.base import Objective, StepCounts


class NextTokenLoss:
    """A micro-batch's loss (module docstring), its float64 parts (ce, aux) and expert counts."""

    PARTS = ("ce_loss", "aux_loss")

    def __init__(self, model: MoETransformer, global_targets: int, global_batch: int):
        self.model, self.global_targets, self.global_batch = model, global_targets, global_batch

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        terms = self.model.loss_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                      batch["document_ids"], batch.get("padding"))
        loss = self.model.objective(terms, self.global_targets, self.global_batch)
        ce = terms.ce_sum.detach().double() / max(self.global_targets, 1)
        return loss, torch.stack([ce, loss.detach().double() - ce]), terms.expert_stats


class NextToken(Objective):
    """Next-token prediction on text and conversations."""

    formats = ("text", "chat")

    def micro_batch_loss(self, counts: StepCounts) -> NextTokenLoss:
        return NextTokenLoss(self.run.model, counts.targets, counts.sequences)

    def record(self, parts: list[float], counts: StepCounts) -> dict:
        return {"loss": sum(parts), **dict(zip(NextTokenLoss.PARTS, parts))}

    def describe(self) -> str:
        d, data = self.run.config.data, self.run.data
        if d.format == "text":
            return f"text ({data.stream.num_sequences} sequences)"
        return (f"chat, loss on {d.loss_on} "
                f"({describe_packed(data.dataset.stats, 'conversations', data.stream.num_sequences)})")
