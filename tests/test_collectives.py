"""Gloo smoke tests of every collective the stack uses, the DistLayout groups, and the harness.

Each run_distributed call bundles many checks, since starting the ranks dominates the cost.
Values are small integers in float32/int64, so every expectation is exact.

Gloo findings (torch 2.13 CPU): all_to_all_single with uneven and zero splits (including a rank
sending nothing), reduce_scatter_tensor (SUM and AVG), all_gather_into_tensor, all_reduce
(SUM/MAX/AVG, float and int64), batch_isend_irecv and async_op=True handles all work, so the stack
needs no gloo fallback. Two gloo limits: all_gather_into_tensor takes only the concatenated form
(inputs [n, ...] -> output [W*n, ...]), not NCCL's stacked form (inputs [k] -> output [W, k]);
and a rank cannot isend/irecv to itself ("Pair is not connected"), so local transfers must be
copies. torch 2.13 deprecates reduce_scatter_tensor / all_gather_into_tensor in favour of
reduce_scatter_single / all_gather_single (FutureWarning); the old names exist across the supported
torch>=2.6, and both spellings are checked here to agree.
"""

import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mop.parallel import DistLayout, Layout, LayoutError
from mop.testing import DistributedError, run_distributed
from mop.testing.distributed import FORK_SERVER_MODULES
from layout_groups import LayoutGroups

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _rows(values):
    """[n, 2] rows (v, -v): all_to_all_single splits along dim 0 of [tokens, hidden]."""
    col = torch.tensor(values, dtype=torch.float32).reshape(-1, 1)
    return torch.cat([col, -col], dim=1)


def _check_all_to_all(rank, world, splits, async_op):
    # Row i of what src sends to dst is tagged 100*src + 10*dst + i; dst receives in src order.
    send = splits[rank]
    recv = [splits[s][rank] for s in range(world)]
    inp = _rows([100 * rank + 10 * d + i for d in range(world) for i in range(send[d])])
    want = _rows([100 * s + 10 * rank + i for s in range(world) for i in range(recv[s])])
    out = torch.full((sum(recv), 2), float("nan"))
    work = dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(out, want), (splits, out)


def collectives(rank, world):
    """Every collective the stack uses, on the world group, with exact expected values."""
    # Harness contract: one thread, the same seed on every rank.
    assert torch.get_num_threads() == 1
    same_seed = torch.rand(3)

    # Uneven all_to_all_single: different splits per rank, zero splits, and a rank sending nothing
    # (an LLEP rank can route no tokens at all).
    mixed = [[(s + 2 * d) % 3 for d in range(world)] for s in range(world)]
    silent = [[0 if s == 0 else 1 + (s + d) % 2 for d in range(world)] for s in range(world)]
    assert any(0 in row for row in mixed)
    for splits in (mixed, silent):
        for async_op in (False, True):
            _check_all_to_all(rank, world, splits, async_op)

    # reduce_scatter: rank r contributes (r+1) * arange; gets block r of the sum.
    k = 3
    full = torch.arange(world * k, dtype=torch.float32)
    total = world * (world + 1) / 2
    rs_ops = [dist.reduce_scatter_tensor] + ([dist.reduce_scatter_single] if hasattr(dist, "reduce_scatter_single") else [])
    for op in rs_ops:
        out = torch.empty(k)
        op(out, (rank + 1) * full)
        assert torch.equal(out, total * full[rank * k:(rank + 1) * k]), (op.__name__, out)
    out = torch.empty(k)
    dist.reduce_scatter_tensor(out, (rank + 1) * full, op=dist.ReduceOp.AVG)
    assert torch.equal(out, total / world * full[rank * k:(rank + 1) * k]), out

    # all_gather into one tensor: [N, H] shards concatenated along dim 0 (the only form gloo
    # takes; NCCL's "stacked" form, output [W, k] for inputs [k], is rejected by gloo).
    mine = torch.tensor([[10.0 * rank + i, -1.0] for i in range(k)])
    expect = torch.tensor([[10.0 * r + i, -1.0] for r in range(world) for i in range(k)])
    ag_ops = [dist.all_gather_into_tensor] + ([dist.all_gather_single] if hasattr(dist, "all_gather_single") else [])
    for op in ag_ops:
        out = torch.empty(world * k, 2)
        op(out, mine)
        assert torch.equal(out, expect), (op.__name__, out)

    # all_reduce: float SUM/MAX/AVG, and int64 SUM (LLEP's per-expert token counts).
    x = torch.tensor([rank + 1.0, -rank])
    for op, want in [
        (dist.ReduceOp.SUM, [total, -(total - world)]),
        (dist.ReduceOp.MAX, [float(world), 0.0]),
        (dist.ReduceOp.AVG, [total / world, -(total - world) / world]),
    ]:
        y = x.clone()
        dist.all_reduce(y, op=op)
        assert torch.equal(y, torch.tensor(want)), (op, y)
    counts = torch.tensor([rank, 2**40], dtype=torch.int64)
    dist.all_reduce(counts)
    assert counts.tolist() == [world * (world - 1) // 2, world * 2**40]

    # batch_isend_irecv ring: send to the right, receive from the left.
    got = _ring(rank, world, torch.tensor([float(rank), 7.0]), group=None)
    assert torch.equal(got, torch.tensor([float((rank - 1) % world), 7.0])), got

    # Several async collectives in flight at once, waited afterwards: results as if synchronous.
    a = torch.full((2,), float(rank))
    b = torch.empty(world)
    c = torch.empty(1)
    works = [
        dist.all_reduce(a, async_op=True),
        dist.all_gather_into_tensor(b, torch.tensor([rank * 2.0]), async_op=True),
        dist.reduce_scatter_tensor(c, torch.ones(world), async_op=True),
    ]
    for w in works:
        w.wait()
    assert torch.equal(a, torch.full((2,), total - world))
    assert torch.equal(b, 2.0 * torch.arange(world, dtype=torch.float32))
    assert torch.equal(c, torch.tensor([float(world)]))
    return rank, same_seed


def _ring(rank, world, tensor, group, ranks=None):
    """Send ``tensor`` to the next rank of ``ranks`` (global ids), receive from the previous."""
    ranks = ranks or list(range(world))
    i, n = ranks.index(rank), len(ranks)
    out = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, ranks[(i + 1) % n], group=group),
        dist.P2POp(dist.irecv, out, ranks[(i - 1) % n], group=group),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    results = run_distributed(collectives, world)
    assert [r for r, _ in results] == list(range(world))  # returned in rank order
    for _, seed in results:
        assert torch.equal(seed, results[0][1])


# Layouts of 4 ranks in which each of D, Ep, P takes each of its values 1, 2, 4.
LAYOUTS_4 = [(1, 2, 4), (2, 4, 1), (4, 1, 2), (2, 2, 2)]


def layout_groups(rank, world, *, layouts):
    """An all_reduce of 2**rank over a group returns the bitmask of exactly its members."""
    for d, ep, p in layouts:
        lay = Layout(world, sequence=d, expert=ep, vocab=p)
        dl = DistLayout(lay, torch.device("cpu"))
        g = LayoutGroups(lay)
        expected = {
            "world_group": list(range(world)),
            "sequence_group": g.of("sequence", rank),
            "expert_group": g.of("expert", rank),
            "expert_p2p_group": g.of("expert", rank),
            "expert_replica_group": g.of("expert_replica", rank),
            "vocab_group": g.of("vocab", rank),
            "vocab_replica_group": g.of("vocab_replica", rank),
        }
        for name, ranks in expected.items():
            group = getattr(dl, name)
            assert dist.get_process_group_ranks(group) == ranks, (lay, name)
            mask = torch.tensor([2**rank], dtype=torch.int64)
            dist.all_reduce(mask, group=group)
            assert mask.item() == sum(2**r for r in ranks), (lay, name, mask)

        # The p2p group is its own communicator, and LLEP's weight ring runs on it. Not at Ep=1:
        # gloo cannot send to self ("Pair is not connected"); LLEP copies locally instead.
        assert dl.expert_p2p_group is not dl.expert_group
        block = g.of("expert", rank)
        if len(block) > 1:
            got = _ring(rank, world, torch.tensor([rank + 0.5]), dl.expert_p2p_group, block)
            assert got.item() == block[(block.index(rank) - 1) % len(block)] + 0.5

        # Mesh dims: 0 = strided replicas, 1 = contiguous blocks (DistLayout also checks this).
        for mesh, n in [(dl.sequence_mesh, d), (dl.expert_mesh, ep), (dl.vocab_mesh, p)]:
            assert mesh.mesh.tolist() == torch.arange(world).reshape(world // n, n).tolist()
            assert dist.get_process_group_ranks(mesh.get_group(0)) == list(range(rank % n, world, n))
            start = rank - rank % n
            assert dist.get_process_group_ranks(mesh.get_group(1)) == list(range(start, start + n))
        assert dl.sequence_mesh.mesh_dim_names == ("data", "sequence")
        assert dl.expert_mesh.mesh_dim_names == ("expert_replica", "expert")
        assert dl.vocab_mesh.mesh_dim_names == ("vocab_replica", "vocab")
        assert dl.expert_replica_mesh.mesh.tolist() == g.of("expert_replica", rank)
        assert dl.world_mesh.mesh.tolist() == list(range(world))

    try:
        DistLayout(Layout(2 * world), torch.device("cpu"))
    except LayoutError as e:
        assert f"the layout is for {2 * world} ranks but {world} were launched" in str(e)
    else:
        raise AssertionError("DistLayout accepted a layout for the wrong world size")


@pytest.mark.parametrize("world,layouts", [(2, [(2, 1, 2), (1, 2, 1)]), (4, LAYOUTS_4)])
def test_layout_groups(world, layouts):
    assert run_distributed(layout_groups, world, layouts=layouts) == [None] * world


def warm_up_groups(rank, world):
    """The process groups that see a collective while a DistLayout is built."""
    seen = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        seen.append(tuple(dist.get_process_group_ranks(group)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    try:
        dl = DistLayout(Layout(world, 2, 4, 1), torch.device("cpu"))
    finally:
        dist.all_reduce = all_reduce
    return seen, tuple(dist.get_process_group_ranks(dl.expert_p2p_group))


def test_every_group_is_warmed_up_once_it_is_created():
    """NCCL creates communicators lazily; a first point-to-point call from part of the LLEP group is
    undefined there: every group, the p2p one included, gets one collective at construction."""
    for rank, (seen, p2p) in enumerate(run_distributed(warm_up_groups, 4)):
        assert seen[0] == (0, 1, 2, 3) and seen[-1] == p2p == (0, 1, 2, 3)
        assert len(seen) == 8  # world, two per mesh (replicas and blocks), the p2p group
        assert (rank - rank % 2, rank - rank % 2 + 1) in seen  # this rank's sequence group


# Harness self-tests.


def test_the_fork_server_imports_start_no_thread():
    """Ranks are forks of a process that imported `FORK_SERVER_MODULES`: a thread started by one of
    those imports (pyarrow's allocator thread did) would be lost in every fork while holding its
    locks. Compared with torch alone, whose import is what the harness has always forked after."""
    script = (f"import os, importlib, torch; before = len(os.listdir('/proc/self/task'))\n"
              f"for name in {FORK_SERVER_MODULES!r}: importlib.import_module(name)\n"
              f"print(before, len(os.listdir('/proc/self/task')))")
    before, after = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                   check=True).stdout.split()
    assert after == before


def fail_in_three_ways(rank, world):
    if rank == 0:
        raise ValueError("boom on rank zero")
    if rank == 1:
        import os

        os._exit(3)  # dies without a traceback, as a segfault or OOM kill would
    time.sleep(600)  # rank 2 blocks forever; the harness must kill it, not wait


def test_failures_are_reported_with_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedError) as e:
        run_distributed(fail_in_three_ways, 3, timeout=60)
    msg = str(e.value)
    assert "rank 0 raised:" in msg and "ValueError: boom on rank zero" in msg
    assert "in fail_in_three_ways" in msg  # the full traceback, not just the exception line
    assert "rank 1 exited with code 3 without reporting a result" in msg
    assert "ranks [2] were still running and were killed" in msg
    assert time.monotonic() - start < 30  # killed after the grace period, not at the timeout
    assert e.value.killed == {}  # an exit code and the harness's own kill are not a signal's end


def killed_by_a_signal(rank, world):
    if rank == 1:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer ends a rank


def test_a_rank_ended_by_a_signal_is_named_with_the_signal():
    with pytest.raises(DistributedError) as e:
        run_distributed(killed_by_a_signal, 2, timeout=60)
    assert e.value.killed == {1: 9} and "rank 1 exited with code -9" in str(e.value)


def p2p_deadlock(rank, world):
    dist.recv(torch.empty(1), src=1 - rank)  # both ranks receive first: neither ever sends


@pytest.mark.slow
def test_deadlock_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 5s: ranks \[0, 1\] were still running"):
        run_distributed(p2p_deadlock, 2, timeout=5)
    assert time.monotonic() - start < 10


def test_unpicklable_fn_fails_in_the_caller():
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_distributed(lambda rank, world: None, 2)


def _smallest_node(rank, world):
    from mop.runtime import smallest_node

    return smallest_node(local_world=4 - rank, device=torch.device("cpu"))  # nodes of unequal size


def test_every_rank_resolves_degrees_from_the_smallest_node():
    assert run_distributed(_smallest_node, 3) == [2, 2, 2]
