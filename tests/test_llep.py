"""Expert parallelism (EP and LLEP) on gloo ranks against the single-process expert layer.

Each rank routes its own tokens with a given routing (balanced, 95% into one expert, or with
empty experts); the parent checks each rank's output and input/routing-weight gradients against
the single-process layer on the concatenated tokens, and every expert weight's gradient (the
partitions gathered from their FSDP2 shards) against the single-process weight gradient.
"""

import pytest
import torch
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.moe import Experts
from mop.models.transformer import init_weights
from mop.parallel import DistLayout, Layout
from mop.parallel.experts import shard_experts
from mop.parallel.llep import BalanceOptions
from mop.parallel.llep_chunked import chunk_segments
from mop.parallel.llep_routing import _segments, build_routing, routing_from_segments, source_segments
from mop.parallel.llep_plan import plan_ep, plan_llep
from mop.testing import rank_device, run_distributed
from conftest import devices, to_cpu

CFG = ModelConfig(hidden=16, experts=8, expert_intermediate=8)
TOKENS = 24  # per rank


def routing(kind: str, world: int, top_k: int, seed: int):
    """Expert ids and weights for every rank's tokens, `[world, TOKENS, k]`."""
    g = torch.Generator().manual_seed(seed)
    choices = {"balanced": list(range(8)), "skewed": list(range(8)), "empty": [1, 2, 5]}[kind]
    ids = torch.zeros(world, TOKENS, top_k, dtype=torch.long)
    for r in range(world):
        for t in range(TOKENS):
            pool = choices[:] if len(choices) >= top_k else list(range(8))
            order = [pool[i] for i in torch.randperm(len(pool), generator=g)]
            if kind == "skewed" and torch.rand((), generator=g) < 0.95:
                order = [0] + [e for e in order if e != 0]
            ids[r, t] = torch.tensor(order[:top_k])
    weights = torch.rand(world, TOKENS, top_k, generator=g)
    return ids, weights


class _Holder(torch.nn.Module):
    """A minimal model shape for shard_experts: layers with an MoE mlp holding `experts`."""

    def __init__(self, experts):
        super().__init__()
        block = torch.nn.Module()
        block.is_moe = True
        block.mlp = torch.nn.Module()
        block.mlp.experts = experts
        self.layers = torch.nn.ModuleList([block])


def reference_experts():
    experts = Experts(CFG)
    init_weights(experts, seed=1, std=0.3)
    return experts


def expert_rank(layout, rank, world, top_k, kind, mode, chunks=1):
    device = layout.device
    holder = _Holder(reference_experts().to(device))
    shard_experts(holder, layout, BalanceOptions(mode, gate=1.3, alpha=1.0, min_chunk=2, chunks=chunks), torch.float32)
    module = holder.layers[0].mlp.experts
    ids, weights = routing(kind, world, top_k, seed=top_k)
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(world, TOKENS, CFG.hidden, generator=g)
    upstream = torch.randn(world, TOKENS, CFG.hidden, generator=g)
    x = x_all[rank].to(device).requires_grad_()
    w = weights[rank].to(device).requires_grad_()
    out = module(x, ids[rank].to(device), w)
    (out * upstream[rank].to(device)).sum().backward()
    partition = layout.layout.expert_partition(rank)
    grads = {name: p.grad.full_tensor() for name, p in module.named_parameters()}
    return to_cpu((out.detach(), x.grad, w.grad, partition, grads, list(module.records)))


CASES = [(world, ep, top_k, kind, mode, chunks) for world, ep in [(2, 2), (4, 2), (4, 4)] for top_k in (1, 2, 4)
         for kind in ("balanced", "skewed", "empty") for mode in ("ep", "llep") for chunks in (1, 3)]


@pytest.mark.parametrize("world, ep", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow), pytest.param(4, 4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("device", devices(4))
def test_expert_parallel_matches_the_single_process_layer(world, ep, device):
    cases = [c for c in CASES if c[:2] == (world, ep)]
    results = run_distributed(_all_cases, world, ep, [c[2:] for c in cases], device=device)
    for index, (_, _, top_k, kind, mode, chunks) in enumerate(cases):
        label = f"W={world} Ep={ep} k={top_k} {kind} {mode} chunks={chunks}"
        experts = reference_experts()
        ids, weights = routing(kind, world, top_k, seed=top_k)
        g = torch.Generator().manual_seed(7)
        x_all = torch.randn(world, TOKENS, CFG.hidden, generator=g)
        upstream = torch.randn(world, TOKENS, CFG.hidden, generator=g)
        x = x_all.reshape(-1, CFG.hidden).clone().requires_grad_()
        w = weights.reshape(-1, top_k).clone().requires_grad_()
        out = experts(x, ids.reshape(-1, top_k), w)
        (out * upstream.reshape(-1, CFG.hidden)).sum().backward()
        per = CFG.experts // ep
        for rank, (r_out, r_x, r_w, partition, grads, records) in enumerate(r[index] for r in results):
            rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
            assert_close(r_out, out.detach()[rows], atol=1e-5, rtol=1e-5, msg=f"output {label}")
            assert_close(r_x, x.grad[rows], atol=1e-5, rtol=1e-5, msg=f"input grad {label}")
            assert_close(r_w, w.grad[rows], atol=1e-5, rtol=1e-5, msg=f"routing weight grad {label}")
            owned = slice(partition * per, (partition + 1) * per)
            assert_close(grads["w_gate_up"], experts.w_gate_up.grad[owned], atol=1e-5, rtol=1e-5, msg=f"w_gate_up {label}")
            assert_close(grads["w_down"], experts.w_down.grad[owned], atol=1e-5, rtol=1e-5, msg=f"w_down {label}")
            if mode == "llep" and kind == "skewed":
                assert records[0]["llep_active"] and records[0]["tokens_moved"] > 0, label
            if mode == "ep":
                assert records[0]["tokens_moved"] == 0, label


def _all_cases(rank, world, ep, cases):
    # One layout for every case: each builds process groups (NCCL communicators on CUDA).
    layout = DistLayout(Layout(world, expert=ep), rank_device())
    return [expert_rank(layout, rank, world, *case) for case in cases]


def test_routing_sends_every_row_once_and_groups_received_rows_by_expert():
    counts = [[5, 0, 3, 1], [2, 4, 0, 0]]  # [ranks, experts]
    loads = [sum(c) for c in zip(*counts)]
    for plan in (plan_ep(loads, 2), plan_llep(loads, 2, gate=1.0, alpha=1.0, min_chunk=1)):
        routes = [build_routing(plan, counts, r) for r in range(2)]
        for r, route in enumerate(routes):
            assert sorted(route.send_rows.tolist()) == list(range(sum(counts[r])))
            assert route.recv_splits == [routes[s].send_splits[r] for s in range(2)]
            assert sorted(route.compute_rows.tolist()) == list(range(sum(route.recv_splits)))
            assert sum(route.native_counts) + sum(route.foreign_counts) == sum(route.recv_splits)
        assert sum(rt.native_counts[i] for rt in routes for i in range(2)) + sum(
            sum(rt.foreign_counts) for rt in routes) == sum(loads)


def rows_by_lists(plan, counts, rank):
    """The routing's row permutations built one row at a time in Python lists (the previous
    implementation): the oracle for the tensor-built ones."""
    ranks, experts = len(counts), len(counts[0])
    before = [[sum(counts[s][e] for s in range(source)) for e in range(experts)] for source in range(ranks)]
    per_source = [_segments(plan, counts[s], before[s]) for s in range(ranks)]
    send_rows = [p for destination in range(ranks) for dest, _, first, rows in per_source[rank] if dest == destination
                 for p in range(first, first + rows)]
    by_expert, position = {}, 0
    for expert, rows in [(e, n) for s in range(ranks) for d, e, _, n in per_source[s] if d == rank]:
        by_expert.setdefault(expert, []).extend(range(position, position + rows))
        position += rows
    per_rank = experts // ranks
    owned = range(rank * per_rank, (rank + 1) * per_rank)
    foreign = sorted(e for e in by_expert if e not in owned)
    return send_rows, [p for e in [*owned, *foreign] for p in by_expert.get(e, [])]


@pytest.mark.parametrize("seed", range(12))
def test_routing_permutations_from_tensor_ops_equal_the_row_by_row_ones(seed):
    g = torch.Generator().manual_seed(seed)
    ranks = (1, 2, 4)[seed % 3]
    experts = ranks * (1, 2, 4)[seed // 3 % 3]
    kind = ("random", "skewed", "empty")[seed % 3 if seed < 9 else 2]
    counts = torch.randint(0, 40, (ranks, experts), generator=g)
    if kind == "skewed":
        counts[:, 0] += 500
    if kind == "empty":
        counts[torch.rand(ranks, experts, generator=g) < 0.7] = 0
        counts[0] = 0  # a rank that routes nothing
    counts = counts.tolist()
    loads = [sum(c) for c in zip(*counts)]
    for plan in (plan_ep(loads, ranks), plan_llep(loads, ranks, gate=1.0, alpha=1.0, min_chunk=1)):
        for rank in range(ranks):
            route = build_routing(plan, counts, rank)
            send_rows, compute_rows = rows_by_lists(plan, counts, rank)
            assert route.send_rows.tolist() == send_rows
            assert route.compute_rows.tolist() == compute_rows


@pytest.mark.parametrize("mode", ["ep", "llep"])
def test_every_chunk_carries_a_fair_share_of_what_each_rank_sends_and_computes(mode):
    """Chunk c takes the c-th part of every routing segment, so with 4 ranks and 2 chunks every rank
    sends and computes about half its rows in each chunk (cutting the plan's slices put a source's
    rows of an expert, consecutive in the global numbering, into one chunk), and the chunks
    together route exactly what the whole plan routes."""
    g = torch.Generator().manual_seed(0)
    ranks, chunks = 4, 2
    counts = torch.randint(20, 60, (ranks, 8), generator=g)
    counts[:, 0] += 300
    counts = counts.tolist()
    loads = [sum(column) for column in zip(*counts)]
    plan = plan_llep(loads, ranks, gate=1.0, alpha=1.0, min_chunk=1) if mode == "llep" else plan_ep(loads, ranks)
    whole = [build_routing(plan, counts, r) for r in range(ranks)]
    per_source = source_segments(plan, counts)
    parts = [[routing_from_segments(part, 8, r, foreign=whole[r].foreign_experts) for r in range(ranks)]
             for part in chunk_segments(per_source, chunks)]
    for r in range(ranks):
        segments = len(per_source[r])
        for splits in ("send_splits", "recv_splits"):
            total = sum(getattr(whole[r], splits))
            per_chunk = [sum(getattr(part[r], splits)) for part in parts]
            assert sum(per_chunk) == total
            assert max(per_chunk) <= total / chunks + segments, (r, splits, per_chunk)
        for key in ("native_counts", "foreign_counts"):
            assert [sum(c) for c in zip(*(getattr(part[r], key) for part in parts))] == getattr(whole[r], key)


def test_a_chunk_without_rows_of_a_shipped_expert_counts_it_as_zero():
    """A chunked layer ships its foreign weights once; a chunk that has no rows for one of them must
    still line its counts up with the shipped weights (the grouped GEMM takes one group per weight)."""
    counts = [[40, 0, 0, 0], [0, 0, 0, 0]]  # rank 0 sends every row to expert 0: rank 1 helps
    plan = plan_llep([40, 0, 0, 0], 2, gate=1.0, alpha=1.0, min_chunk=1)
    helper_rows = [s for s in plan.slices if s.rank == 1]
    assert helper_rows, "the plan must spill expert 0 to rank 1"
    first_chunk = chunk_segments(source_segments(plan, counts), 4)[0]
    route = routing_from_segments(first_chunk, 4, 1, foreign=[0, 1])  # weights of experts 0 and 1 shipped
    assert route.foreign_experts == [0, 1] and route.foreign_counts[1] == 0
    assert sum(route.native_counts) + sum(route.foreign_counts) == sum(route.recv_splits)
    with pytest.raises(ValueError, match="receives rows of experts"):
        routing_from_segments(first_chunk, 4, 1, foreign=[1])


def zero_token_rank(rank, world, mode, chunks):
    """Rank 1 routes no tokens at all; rank 0 sends 95% of its assignments to expert 0."""
    device = rank_device()
    layout = DistLayout(Layout(world, expert=world), device)
    holder = _Holder(reference_experts().to(device))
    shard_experts(holder, layout, BalanceOptions(mode, gate=1.0, alpha=1.0, min_chunk=1, chunks=chunks), torch.float32)
    module = holder.layers[0].mlp.experts
    ids, weights = routing("skewed", 1, 2, seed=5)
    x_all = torch.randn(TOKENS, CFG.hidden, generator=torch.Generator().manual_seed(3))
    tokens = TOKENS if rank == 0 else 0
    x = x_all[:tokens].to(device).requires_grad_()
    w = weights[0, :tokens].to(device).requires_grad_()
    out = module(x, ids[0, :tokens].to(device), w)
    out.sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in module.named_parameters()}
    return to_cpu((out.detach(), x.grad, w.grad, grads))


@pytest.mark.parametrize("device", devices(2))
@pytest.mark.parametrize("mode, chunks", [pytest.param("ep", 1, marks=pytest.mark.slow), pytest.param("llep", 1, marks=pytest.mark.slow), ("llep", 3)])
def test_a_rank_with_no_tokens_still_takes_part(mode, chunks, device):
    results = run_distributed(zero_token_rank, 2, mode, chunks, device=device)
    experts = reference_experts()
    ids, weights = routing("skewed", 1, 2, seed=5)
    x = torch.randn(TOKENS, CFG.hidden, generator=torch.Generator().manual_seed(3)).requires_grad_()
    w = weights[0].clone().requires_grad_()
    out = experts(x, ids[0], w)
    out.sum().backward()
    assert_close(results[0][0], out.detach(), atol=1e-5, rtol=1e-5)
    assert_close(results[0][1], x.grad, atol=1e-5, rtol=1e-5)
    assert_close(results[0][2], w.grad, atol=1e-5, rtol=1e-5)
    assert results[1][0].shape == (0, CFG.hidden)
    for rank, (_, _, _, grads) in enumerate(results):
        owned = slice(rank * 4, (rank + 1) * 4)
        assert_close(grads["w_gate_up"], experts.w_gate_up.grad[owned], atol=1e-5, rtol=1e-5)
        assert_close(grads["w_down"], experts.w_down.grad[owned], atol=1e-5, rtol=1e-5)
