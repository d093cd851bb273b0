"""The LLEP planner (`mop.parallel.llep_plan`): invariants of its module docstring; no processes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mop.parallel.llep_plan import Plan, Slice, imbalance, plan_ep, plan_llep

EXPERTS = [1, 2, 4, 8, 16, 32]


@st.composite
def group_loads(draw):
    """(loads, ranks): many zero or tiny experts, a few hot ones (heavy skew)."""
    experts = draw(st.sampled_from(EXPERTS))
    ranks = draw(st.sampled_from([d for d in range(1, experts + 1) if experts % d == 0]))
    load = st.one_of(st.just(0), st.integers(0, 64), st.integers(0, 5000))
    loads = draw(st.lists(load, min_size=experts, max_size=experts))
    factor = draw(st.sampled_from([1, 10, 100]))
    for e in draw(st.lists(st.integers(0, experts - 1), max_size=3, unique=True)):
        loads[e] *= factor
    return loads, ranks


knobs = st.fixed_dictionaries(
    {
        "gate": st.sampled_from([1.0, 1.3, 2.0]),  # 1.0: LLA whenever Ep > 1 and there are tokens
        "alpha": st.sampled_from([0.5, 1.0, 1.1, 1.5, 2.0]),
        "min_chunk": st.sampled_from([1, 64, 1024, 4096]),
    }
)


def native(e, loads, ranks):
    return e // (len(loads) // ranks)


def check_plan(plan: Plan, loads, ranks, min_chunk=1) -> None:
    """Every invariant a plan must hold, recomputed from the slices."""
    assert (plan.experts, plan.ranks) == (len(loads), ranks)
    assert isinstance(plan.slices, tuple)
    assert list(plan.slices) == sorted(plan.slices, key=lambda s: (s.expert, s.start))
    # Coverage: each expert's slices are non-empty and tile [0, load); zero-load experts absent.
    for e, load in enumerate(loads):
        mine = plan.slices_of(e)
        assert [s.start for s in mine] == [0] + [s.stop for s in mine[:-1]] if mine else load == 0
        assert all(s.stop > s.start and 0 <= s.rank < ranks for s in mine)
        assert (mine[-1].stop if mine else 0) == load
    assert sum(plan.rank_loads()) == sum(loads)
    expected_rank_loads = [sum(s.stop - s.start for s in plan.slices if s.rank == r) for r in range(ranks)]
    assert plan.rank_loads() == expected_rank_loads
    # Helpers: the weights to ship and the experts each rank computes follow from the slices.
    off_native = {(s.expert, native(s.expert, loads, ranks), s.rank) for s in plan.slices}
    assert plan.transfers() == sorted(t for t in off_native if t[1] != t[2])
    for r in range(ranks):
        assert plan.compute_experts(r) == sorted({s.expert for s in plan.slices if s.rank == r})
    if plan.balanced:
        assert plan == plan_ep(loads, ranks)
        return
    # Capacity: only ranks holding a forced slice may exceed it; the native share is never forced.
    forced_ranks = {s.rank for s in plan.slices if s.forced}
    for r, load in enumerate(plan.rank_loads()):
        assert r in forced_ranks or load <= plan.capacity
    for s in plan.slices:
        if s.rank == native(s.expert, loads, ranks):
            assert not s.forced and s.start == 0
        elif not s.forced:  # a helper's chunk is worth its GEMM, or finishes the expert
            assert s.stop - s.start >= min_chunk or s.stop == loads[s.expert]


@settings(deadline=None, max_examples=300)
@given(group_loads(), knobs)
def test_plan_invariants(case, kw):
    loads, ranks = case
    plan = plan_llep(loads, ranks, **kw)
    check_plan(plan, loads, ranks, kw["min_chunk"])
    gated = ranks == 1 or sum(loads) == 0 or imbalance(loads) < kw["gate"]
    assert plan.balanced == gated
    if not gated:
        assert plan.capacity >= kw["alpha"] * sum(loads) / ranks  # ceil, never below


@settings(deadline=None)
@given(group_loads(), st.sampled_from([1.0, 1.1, 2.0]))
def test_enough_capacity_and_unit_chunks_never_force(case, alpha):
    loads, ranks = case
    plan = plan_llep(loads, ranks, gate=1.0, alpha=alpha, min_chunk=1)
    check_plan(plan, loads, ranks)
    assert not any(s.forced for s in plan.slices)
    assert plan.balanced or max(plan.rank_loads()) <= plan.capacity


@settings(deadline=None)
@given(group_loads())
def test_plan_ep(case):
    loads, ranks = case
    plan = plan_ep(loads, ranks)
    check_plan(plan, loads, ranks)
    assert plan.balanced and plan.capacity is None and plan.transfers() == []
    assert plan.slices == tuple(
        Slice(e, native(e, loads, ranks), 0, load, False) for e, load in enumerate(loads) if load
    )
    per_rank = len(loads) // ranks
    assert plan.rank_loads() == [sum(loads[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]


@settings(deadline=None)
@given(group_loads(), knobs)
def test_gate(case, kw):
    loads, ranks = case
    ratio = imbalance(loads)
    assert plan_llep(loads, ranks, **{**kw, "gate": ratio + 1e-9}) == plan_ep(loads, ranks)
    at_gate = plan_llep(loads, ranks, **{**kw, "gate": ratio})  # strict: max/mean == gate runs LLA
    assert at_gate.balanced == (ranks == 1 or sum(loads) == 0)


@pytest.mark.parametrize("experts,ranks", [(1, 1), (4, 2), (8, 4), (32, 8), (32, 32)])
@pytest.mark.parametrize("load", [0, 1, 1000])
def test_equal_loads_are_plain_ep(experts, ranks, load):
    loads = [load] * experts
    plan = plan_llep(loads, ranks)
    assert plan.balanced and plan.transfers() == [] and plan == plan_ep(loads, ranks)


def test_single_rank_is_plain_ep_however_skewed():
    loads = [100_000, 0, 0, 1]
    assert plan_llep(loads, 1, gate=1.0) == plan_ep(loads, 1)


@pytest.mark.parametrize("experts,ranks,hot", [(8, 4, 0), (8, 4, 5), (32, 8, 13), (16, 16, 3)])
def test_extreme_skew_spreads_the_hot_expert(experts, ranks, hot):
    total = 8192 * ranks
    loads = [(total - total * 95 // 100) // (experts - 1)] * experts
    loads[hot] = total * 95 // 100
    plan = plan_llep(loads, ranks)
    check_plan(plan, loads, ranks, min_chunk=1024)
    assert not plan.balanced and not any(s.forced for s in plan.slices)
    assert sorted(s.rank for s in plan.slices_of(hot)) == list(range(ranks))
    assert max(plan.rank_loads()) <= plan.capacity
    owner = hot // (experts // ranks)
    assert plan.transfers() == [(hot, owner, r) for r in range(ranks) if r != owner]


def test_spill_worked_example():
    # E=4 on 2 ranks, capacity 2250: expert 0 keeps 2250 - 250 pending = 2000 on rank 0, spills
    # 2500 - 2000 = 500 (< min_chunk, but the whole remainder) to rank 1; expert 1 (case 1) fits.
    plan = plan_llep([2500, 250, 1500, 250], 2, min_chunk=1024)
    assert plan.capacity == 2250
    assert plan.slices == (
        Slice(0, 0, 0, 2000, False),
        Slice(0, 1, 2000, 2500, False),
        Slice(1, 0, 0, 250, False),
        Slice(2, 1, 0, 1500, False),
        Slice(3, 1, 0, 250, False),
    )
    assert plan.rank_loads() == [2250, 2250] and plan.transfers() == [(0, 0, 1)]
    assert plan.compute_experts(0) == [0, 1] and plan.compute_experts(1) == [0, 2, 3]


def test_forced_worked_example():
    # Capacity 1750. Expert 0 keeps 1750 and its 2250 rest would split into chunks of 750 < 1024:
    # forced onto rank 1 (least loaded, lowest index). Expert 1's rank is then over capacity
    # (case 3), so its 1000 tokens are forced onto rank 2, which ends within capacity anyway
    # because its own expert 2 takes only the 750 left and spills the final 250 to rank 3.
    plan = plan_llep([4000, 1000, 1000, 1000], 4, min_chunk=1024)
    assert plan.capacity == 1750
    assert plan.slices == (
        Slice(0, 0, 0, 1750, False),
        Slice(0, 1, 1750, 4000, True),
        Slice(1, 2, 0, 1000, True),
        Slice(2, 2, 0, 750, False),
        Slice(2, 3, 750, 1000, False),
        Slice(3, 3, 0, 1000, False),
    )
    assert plan.rank_loads() == [1750, 2250, 1750, 1250]
    assert plan.transfers() == [(0, 0, 1), (1, 1, 2), (2, 2, 3)]
    assert plan.compute_experts(1) == [0]


def test_helper_may_hold_a_filled_and_a_forced_slice():
    # Capacity 1800 (alpha < 1: the ranks cannot hold every token). Rank 1 takes 800, its room
    # beside its pending 1000; the 400 left has nowhere to go and is forced back onto rank 1.
    plan = plan_llep([3000, 0, 0, 1000], 2, alpha=0.9, min_chunk=512)
    assert plan.capacity == 1800
    assert plan.slices_of(0) == [
        Slice(0, 0, 0, 1800, False),
        Slice(0, 1, 1800, 2600, False),
        Slice(0, 1, 2600, 3000, True),
    ]


@settings(deadline=None)
@given(group_loads(), knobs, st.randoms(use_true_random=False))
def test_deterministic(case, kw, rnd):
    loads, ranks = case
    plan = plan_llep(loads, ranks, **kw)
    # "Every rank" computes from its own copy of the all-reduced loads: the plans must be equal.
    assert plan_llep(list(loads), ranks, **kw) == plan
    assert plan_llep(tuple(loads), ranks, **kw) == plan
    order = list(range(len(loads)))
    rnd.shuffle(order)
    shuffled = [loads[i] for i in order]
    restored = [0] * len(loads)
    for i, load in zip(order, shuffled):
        restored[i] = load
    assert plan_llep(restored, ranks, **kw) == plan


def test_imbalance():
    assert imbalance([0, 0, 0, 0]) == 1.0
    assert imbalance([5, 5]) == 1.0
    assert imbalance([3, 1]) == 1.5
    assert imbalance([8, 0, 0, 0]) == 4.0


def test_rejects_experts_not_divisible_by_ranks():
    with pytest.raises(AssertionError):
        plan_llep([1, 2, 3], 2)
    with pytest.raises(AssertionError):
        plan_ep([1, 2, 3], 2)
