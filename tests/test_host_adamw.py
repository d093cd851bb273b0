"""The host optimizer against torch.optim.AdamW: speculative updates, rollback under clipping, skips."""

import math
import time

import pytest
import torch
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from mop.optim.host_adamw import HostAdamW
from conftest import devices

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


def wait_for_speculation(host: HostAdamW) -> None:
    """Let every speculative piece run before the norm arrives, so the rollback path is certain."""
    for shard in host.shards:
        for future in shard.pending:
            future.result()


# "settled": every piece speculated before `finish` (deterministic rollbacks); "racing": `finish`
# right away, so pieces are speculated, in flight or cancelled depending on timing.
@pytest.mark.parametrize("arrival, speculative, timing", [("in order", True, "settled"), ("reversed", True, "settled"),
                                                          ("in order", True, "racing"), ("in order", False, "racing")])
def test_matches_torch_adamw_with_clipping_and_a_skipped_step(arrival, speculative, timing):
    reference, mine = make_params(), make_params()
    torch_opt = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    # Pieces of 7 elements: several per shard, the last one short.
    host = HostAdamW(groups(mine), betas=(0.9, 0.95), eps=1e-8, workers=2, speculative=speculative, piece_elements=7)
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
        if timing == "settled":
            wait_for_speculation(host)
        redone.append(host.finish(norm.item(), 1.0))
        host.synchronize()  # finish only queues the settling
        for index, (ref, got) in enumerate(zip(reference, mine)):
            assert_close(got.detach(), ref.detach(), atol=1e-6, rtol=1e-6, msg=f"step {step} param {index}")
    # Speculation is rolled back on the clipped steps (1 and 4); a skipped step restores, it is no rollback.
    if timing == "settled":
        assert redone == [False, True, False, False, True, False]
        assert host.rollbacks == 2
    else:  # a cancelled speculation needs no rollback
        assert not any(redone[step] for step in (0, 2, 3, 5)) and host.rollbacks == sum(redone)
        if not speculative:
            assert host.rollbacks == 0
    for got, ref in zip(mine, reference):
        shard, state = host.shard_of(got), torch_opt.state[ref]
        assert_close(shard.exp_avg, state["exp_avg"], atol=1e-6, rtol=1e-6)
        assert_close(shard.exp_avg_sq, state["exp_avg_sq"], atol=1e-6, rtol=1e-6)
        assert shard.step.item() == state["step"].item() == STEPS - 1


SMALL = ModelConfig(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, experts=4,
                    expert_intermediate=16)
CLIPPED_STEP = 1


def groups_by_dim(model):
    """The trainer's groups: weight decay on matrices, none on norms."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class SlowSettling(HostAdamW):
    """Settles every shard 20 ms late: a forward that did not wait for its parameters would read stale weights."""

    def _settle(self, *args):
        time.sleep(0.02)
        super()._settle(*args)


def _fsdp_host_steps(rank, world, steps):
    """HostAdamW on FSDP2 shards, and torch.optim.AdamW on full copies fed the same (gathered) gradients.

    Feeding the reference FSDP2's own gradients keeps the reduction order out of the comparison:
    Adam turns a rounding-level gradient difference in a barely used row into a full-size step, so
    only identical gradients can show that the optimizer itself is exact. The updates are settled
    late and the next forward is not synchronised by hand: only the feed's waits keep it exact.
    """
    import torch.distributed as dist

    from mop.optim.pipeline import GradientFeed
    from mop.parallel import DistLayout, Layout
    from mop.parallel.fsdp import shard_dense
    from mop.optim.optimizer import global_norm

    layout = DistLayout(Layout(world), torch.device("cpu"))
    model, reference = build_model(SMALL, seed=4), build_model(SMALL, seed=4)
    shard_dense(model, layout)
    host = SlowSettling(groups_by_dim(model), betas=(0.9, 0.95))
    torch_opt = torch.optim.AdamW(groups_by_dim(reference), lr=1e-2, betas=(0.9, 0.95))
    feed = GradientFeed(model, host)
    first_block = list(model.layers[0].parameters())
    pending_at_hand_over = []  # per delivery: how many of block 0's gradients did not exist yet
    handed_over = {}  # the gradients the feed delivered (and released from the parameters)
    deliver = host.gradient_ready

    def recording_gradient_ready(param, grad, last):
        pending_at_hand_over.append(sum(p.grad is None and id(p) not in handed_over for p in first_block))
        handed_over[id(param)] = grad
        deliver(param, grad, last)

    def compare(when):
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            try:
                assert_close(param.full_tensor(), ref.detach(), atol=1e-6, rtol=1e-6)
            except AssertionError as err:
                mismatches.append(f"{when} {name}: {err}")

    host.gradient_ready = recording_gradient_ready
    early, clipped, losses, mismatches = [], [], [], []
    for step in range(steps):
        ids = torch.randint(0, SMALL.vocab_size, (2 * world, 17), generator=torch.Generator().manual_seed(step))
        mine = ids[2 * rank:2 * rank + 2]
        host.begin_step(1e-2)
        feed.before_forward()
        ce_sum = model.loss_terms(mine[:, :-1], mine[:, 1:]).ce_sum
        compare(f"after the forward of step {step}")  # the forward waited for every block
        with torch.no_grad():
            reference_ce_sum = reference.loss_terms(ids[:, :-1], ids[:, 1:]).ce_sum
        feed.arm(last=True)
        (ce_sum / (ids.shape[0] * 16)).backward()
        early.append(feed.early)
        feed.flush()
        assert all(p.grad is None for p in model.parameters())  # released at hand-over
        total = ce_sum.detach().clone()
        dist.all_reduce(total)
        losses.append((total.item(), reference_ce_sum.item()))
        for param, ref in zip(model.parameters(), reference.parameters()):
            ref.grad = handed_over.pop(id(param)).full_tensor()
        max_norm = 0.05 if step == CLIPPED_STEP else 100.0
        host.finish(global_norm(host.local_squared_norm(), layout.world_group, layout.device).item(), max_norm)
        clipped.append(host.last_clipped)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        torch_opt.step()
        torch_opt.zero_grad()
        model.zero_grad(set_to_none=True)
    host.synchronize()
    compare("at the end")
    return early, clipped, losses, pending_at_hand_over[0], mismatches


def test_fsdp2_sharded_parameters_end_where_torch_adamw_takes_them():
    from mop.testing import run_distributed

    count = len(list(build_model(SMALL, seed=4).parameters()))
    for early, clipped, losses, pending, mismatches in run_distributed(_fsdp_host_steps, 2, 3):
        assert mismatches == []
        for mine, reference in losses:  # each forward saw the updated weights
            assert_close(mine, reference, atol=0, rtol=1e-6)
        assert clipped == [step == CLIPPED_STEP for step in range(3)]
        # Every FSDP2-managed gradient was handed over from inside the backward, the first of them
        # while block 0's gradients were still to be computed.
        assert early == [count] * 3
        assert pending == len(list(build_model(SMALL, seed=4).layers[0].parameters()))


@pytest.mark.parametrize("device", devices(1))
@pytest.mark.parametrize("working_dtype", [torch.float32, torch.bfloat16])
def test_micro_batches_accumulate_on_the_host_even_when_the_last_one_skips_a_parameter(working_dtype, device):
    """Micro-batch gradients are summed in fp32 on the host (on CUDA through pinned staging copies on
    the current stream); a parameter the last micro-batch did not reach is still updated
    (`gradients_final`), and the norm covers it."""
    reference = make_params()
    mine = [torch.nn.Parameter(p.detach().to(device, working_dtype)) for p in make_params()]
    for ref in reference:  # the same starting point as the (possibly rounded) working weights
        ref.data.copy_(ref.data.to(working_dtype))
    torch_opt = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    host = HostAdamW(groups(mine), betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(7)
    first = [torch.randn(p.shape, generator=g).to(device, working_dtype) for p in mine]
    last = [torch.randn(p.shape, generator=g).to(device, working_dtype) for p in mine[:2]]  # params 2 and 3 skip it
    for ref, a, b in zip(reference, first, last + [None, None]):
        ref.grad = a.float().cpu() + (b.float().cpu() if b is not None else 0)
    norm = torch.nn.utils.clip_grad_norm_(reference, 100.0)
    torch_opt.step()
    host.begin_step(1e-2)
    for param, grad in zip(mine, first):
        host.gradient_ready(param, grad.clone(), last=False)
    for param, grad in zip(mine, last):
        host.gradient_ready(param, grad.clone(), last=True)
    host.gradients_final()
    assert_close(host.local_squared_norm().sqrt(), norm, atol=1e-6, rtol=1e-6)
    host.finish(norm.item(), 100.0)
    host.synchronize()
    for index, (ref, param) in enumerate(zip(reference, mine)):
        assert_close(host.state_of(param)["master"], ref.detach(), atol=1e-6, rtol=1e-6, msg=f"param {index}")
        assert_close(param.detach().cpu(), ref.detach().to(working_dtype), atol=0, rtol=0, msg=f"working {index}")
