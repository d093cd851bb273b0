"""The GRPO family's losses (`mop.objectives.policy_gradient.loss`) against TRL 1.16's own
`GRPOTrainer._compute_loss` given the same per-token log-probs (the trainer built without a model,
its forward replaced by the given log-probs), for each loss type, with the KL and the
train-inference correction."""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from mop.objectives.policy_gradient.loss import (
    PolicyLoss,
    aggregation_weights,
    correction,
    record_sums,
    token_losses,
)

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402  (after the skip)

ROWS, LENGTH = 4, 6


class _Identity:
    """The accelerator of one process: gathers and reductions return their input."""

    num_processes = 1

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor


def trl_loss(loss: PolicyLoss, logps, old, reference, advantages, mask, corrections):
    """TRL's `_compute_loss` on one micro-batch of one process, its forward replaced by `logps`."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=loss.importance_sampling_level,
        beta=loss.beta, loss_type=loss.loss_type, epsilon_low=loss.epsilon, epsilon_high=loss.high,
        use_vllm=corrections is not None, vllm_importance_sampling_correction=corrections is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=loss.max_completion_length, accelerator=_Identity(), _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=loss.kl_bias_correction, delta=loss.delta, steps_per_generation=1))
    entropies = torch.linspace(0.5, 2.0, logps.numel()).view_as(logps)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    inputs = {"prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long), "prompt_mask": torch.ones(ROWS, 1),
              "completion_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": reference,
              "num_items_in_batch": mask.sum()}
    if corrections is not None:
        inputs["importance_sampling_ratio"] = corrections
    value = trainer._compute_loss(None, inputs)
    return value, {k: v[-1] for k, v in trainer._metrics["train"].items()}, entropies


def rollout_sums(values: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """A `loss.RolloutSum` of one rank's whole rollouts: `rollout` numbers each token's rollout."""
    return values.new_zeros(values.shape).index_add(0, rollout, values)[rollout]


def mop_loss(loss: PolicyLoss, logps, old, reference, advantages, mask, corrections, entropies):
    """The same step through mop's functions: the completion's tokens flattened, weights counted."""
    kept = mask.bool()
    rows = torch.arange(ROWS).unsqueeze(1).expand_as(mask)[kept]
    rollout_tokens = mask.sum(-1)[rows]
    per_token_advantages = advantages[rows]
    losses, ratio, kl = token_losses(loss, logps[kept], old[kept], per_token_advantages,
                                     reference[kept] if loss.beta else None,
                                     corrections[kept] if corrections is not None else None,
                                     partial(rollout_sums, rollout=rows), rollout_tokens)
    weights = aggregation_weights(loss, rollout_tokens, ROWS, int(mask.sum()))
    sums = record_sums(loss, ratio, per_token_advantages, kl, entropies[kept], torch.full_like(ratio, 1 / mask.sum()),
                       1.0 / (rollout_tokens * ROWS))
    return (weights * losses).sum(), {k: float(v) for k, v in sums.items()}


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(ROWS, LENGTH)
    mask[1, 4:] = 0  # completions of different lengths, one of a single token
    mask[3, 1:] = 0
    old = -torch.rand(ROWS, LENGTH, generator=generator) * 3
    logps = (old + torch.randn(ROWS, LENGTH, generator=generator) * 0.4).requires_grad_()
    reference = old + torch.randn(ROWS, LENGTH, generator=generator) * 0.3
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    sampling = old + torch.randn(ROWS, LENGTH, generator=generator) * 0.5
    return logps, old, reference, advantages, mask, sampling


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo", "cispo"])
@pytest.mark.parametrize("variant", ["plain", "kl+correction", "delta+high", "sequence+kl+correction"])
def test_each_loss_type_equals_trls_loss_records_and_gradient(loss_type, variant):
    """Token-level ratios, and sequence-level ones (GSPO: each rollout's mean log-ratio)."""
    beta = 0.04 if "kl" in variant else 0.0
    loss = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=(5.0 if loss_type == "cispo" else 0.28)
                      if variant == "delta+high" else None, delta=1.5 if variant == "delta+high" else None,
                      beta=beta, max_completion_length=LENGTH,
                      importance_sampling_level="sequence" if variant.startswith("sequence") else "token")
    logps, old, reference, advantages, mask, sampling = _inputs(seed=len(loss_type) + len(variant))
    corrections = None
    if "correction" in variant:
        kept = mask.bool()
        corrections = torch.ones(ROWS, LENGTH)
        corrections[kept] = correction(old[kept], sampling[kept], None, "token_truncate", None, 2.0)
    expected, metrics, entropies = trl_loss(loss, logps, old, reference, advantages, mask, corrections)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    got, sums = mop_loss(loss, logps, old, reference, advantages, mask, corrections, entropies)
    (grad,) = torch.autograd.grad(got, logps)
    assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert_close(grad, expected_grad, rtol=1e-6, atol=1e-8)
    for key, value in sums.items():
        assert math.isclose(value, metrics[key], rel_tol=1e-6, abs_tol=1e-9), (key, value, metrics[key])
    assert {k for k in metrics if "mean" in k or k in ("kl", "entropy", "cispo_clip_ratio")} == set(sums)


def test_the_correction_per_token_and_per_rollout():
    """TRL's four modes: exp of the old pass's log-prob less the engine's, per token or summed over a
    rollout; truncated into the caps, or 0 outside them; an unknown sampling log-prob corrects nothing."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    sampling = torch.tensor([-1.5, -1.0, float("nan"), -2.0])
    rollout = partial(rollout_sums, rollout=torch.tensor([0, 0, 1, 1]))
    token = torch.tensor([0.5, -1.0, 0.0, -1.0]).exp()
    assert_close(correction(old, sampling, rollout, "token_truncate", 0.5, 1.5), token.clamp(0.5, 1.5))
    assert_close(correction(old, sampling, rollout, "token_mask", None, 1.5),
                 torch.where(token > 1.5, 0.0, token))
    sequence = torch.tensor([-0.5, -0.5, -1.0, -1.0]).exp()
    assert_close(correction(old, sampling, rollout, "sequence_truncate", None, 3.0), sequence)
    assert_close(correction(old, sampling, rollout, "sequence_mask", 0.5, None),
                 torch.where(sequence < 0.5, 0.0, sequence))
