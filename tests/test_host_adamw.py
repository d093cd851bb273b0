"""The host optimizer against torch.optim.AdamW: speculative updates, rollback under clipping, skips."""

import math

import pytest
import torch
from torch.testing import assert_close

from mop.optim.host_adamw import HostAdamW

STEPS = 6
# Gradient scale per step: clipping (max_norm 1.0) is active on the large steps, not on the small;
# step 3 carries an inf and must be skipped.
SCALES = [0.01, 5.0, 0.02, float("inf"), 3.0, 0.005]


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(8, 4), (4,), (3, 5, 2), (6,)]]


def gradients(step: int, params, micro_batches: int = 2):
    """Each gradient accumulated over micro-batches, scaled for the step; an inf on the inf step."""
    g = torch.Generator().manual_seed(100 + step)
    scale = SCALES[step] if math.isfinite(SCALES[step]) else 1.0
    grads = [scale * sum(torch.randn(p.shape, generator=g) for _ in range(micro_batches)) for p in params]
    if not math.isfinite(SCALES[step]):
        grads[2][0, 0, 0] = float("inf")
    return grads


def groups(params):
    return [{"params": [params[0], params[2]], "weight_decay": 0.1}, {"params": [params[1], params[3]], "weight_decay": 0.0}]


@pytest.mark.parametrize("arrival, speculative", [("in order", True), ("reversed", True), ("in order", False)])
def test_matches_torch_adamw_with_clipping_and_a_skipped_step(arrival, speculative):
    reference, mine = make_params(), make_params()
    torch_opt = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    host = HostAdamW(groups(mine), betas=(0.9, 0.95), eps=1e-8, workers=2, speculative=speculative)
    redone = []
    for step in range(STEPS):
        lr = 1e-2 * (step + 1) / STEPS
        for group in torch_opt.param_groups:
            group["lr"] = lr
        grads = gradients(step, reference)
        for param, grad in zip(reference, grads):
            param.grad = grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
        if torch.isfinite(norm):
            torch_opt.step()
        torch_opt.zero_grad()

        host.begin_step(lr)
        order = range(len(mine)) if arrival == "in order" else reversed(range(len(mine)))
        for index in order:  # as the backward would deliver them, before the norm is known
            host.gradient_ready(mine[index], grads[index])
        redone.append(host.finish(norm.item(), 1.0))
        for index, (ref, got) in enumerate(zip(reference, mine)):
            assert_close(got.detach(), ref.detach(), atol=1e-6, rtol=1e-6, msg=f"step {step} param {index}")
    # Speculation is rolled back on the clipped steps (1 and 4); a skipped step restores, it is no rollback.
    assert redone == ([False, True, False, False, True, False] if speculative else [False] * STEPS)
    assert host.rollbacks == (2 if speculative else 0)
    for got, ref in zip(mine, reference):
        shard, state = host.shard_of(got), torch_opt.state[ref]
        assert_close(shard.exp_avg, state["exp_avg"], atol=1e-6, rtol=1e-6)
        assert_close(shard.exp_avg_sq, state["exp_avg_sq"], atol=1e-6, rtol=1e-6)
        assert shard.step.item() == state["step"].item() == STEPS - 1


def test_state_dict_round_trip():
    params = make_params()
    host = HostAdamW(groups(params))
    host.begin_step(1e-3)
    for param, grad in zip(params, gradients(0, params)):
        host.gradient_ready(param, grad)
    host.finish(0.5, 1.0)
    other = HostAdamW(groups(make_params()))
    other.load_state_dict(host.state_dict())
    for a, b in zip(host.shards, other.shards):
        assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq) and torch.equal(a.working, b.working)
