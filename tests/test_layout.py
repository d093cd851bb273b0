"""Rank arithmetic of ``mop.parallel.Layout`` and the process-setup helpers; no processes."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mop.parallel import Layout, LayoutError, TorchrunEnv, backend_for, device_for, set_rank_threads
from layout_groups import LayoutGroups

WORLDS = [1, 2, 3, 4, 6, 8, 12, 16, 64]


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(lay: Layout) -> None:
    """Every invariant of the module docstring, for one layout."""
    w = lay.world
    g = LayoutGroups(lay)
    families = {
        "sequence": (g.sequence, lay.sequence, "block"),
        "expert": (g.expert, lay.expert, "block"),
        "expert_replica": (g.expert_replica, lay.expert, "replica"),
        "vocab": (g.vocab, lay.vocab, "block"),
        "vocab_replica": (g.vocab_replica, lay.vocab, "replica"),
    }
    for name, (groups, n, kind) in families.items():
        # A partition: every rank exactly once.
        assert sorted(r for group in groups for r in group) == list(range(w)), name
        for i, group in enumerate(groups):
            if kind == "block":
                assert group == list(range(i * n, (i + 1) * n)), name  # contiguous, in order
            else:
                assert group == list(range(i, w, n)), name  # strided by n, partition i
        assert len(groups) == (w // n if kind == "block" else n), name
    assert lay.expert_groups() == g.expert
    assert lay.vocab_replicas == len(g.vocab_replica[0]) == w // lay.vocab

    for r in range(w):
        eg, er = g.of("expert", r), g.of("expert_replica", r)
        assert eg.index(r) == lay.expert_partition(r)
        assert er == g.expert_replica[lay.expert_partition(r)]
        assert er.index(r) == g.index("expert", r)  # the FSDP shard index of the partition
        assert all(lay.expert_partition(q) == lay.expert_partition(r) for q in er)
        assert set(eg) & set(er) == {r}  # block x replica is a grid: they meet only at r

        vg, vr = g.of("vocab", r), g.of("vocab_replica", r)
        assert vg.index(r) == lay.vocab_shard(r)
        assert vr == g.vocab_replica[lay.vocab_shard(r)]
        assert vr.index(r) == g.index("vocab", r)
        assert set(vg) & set(vr) == {r}


@pytest.mark.parametrize("world", WORLDS)
def test_every_divisor_combination(world):
    for d, ep, p in itertools.product(divisors(world), repeat=3):
        check_layout(Layout(world, sequence=d, expert=ep, vocab=p))


@given(st.integers(1, 256).flatmap(lambda w: st.tuples(
    st.just(w), st.sampled_from(divisors(w)), st.sampled_from(divisors(w)), st.sampled_from(divisors(w)))))
def test_random_layouts(wdep):
    check_layout(Layout(*wdep))


def test_design_example_w8():
    lay = Layout(world=8, sequence=4, expert=8, vocab=2)
    g = LayoutGroups(lay)
    assert g.sequence == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g.index("sequence", r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # the data-parallel replica
    assert lay.expert_groups() == g.expert == [list(range(8))]
    assert g.expert_replica == [[r] for r in range(8)]
    assert [lay.expert_partition(r) for r in range(8)] == list(range(8))
    assert g.vocab == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.vocab_replica == [[0, 2, 4, 6], [1, 3, 5, 7]] and lay.vocab_replicas == 4
    assert g.of("vocab_replica", 5) == [1, 3, 5, 7] and lay.vocab_shard(5) == 1


def test_expert_replicas_shard_one_partition():
    lay = Layout(world=8, expert=2)
    g = LayoutGroups(lay)
    assert lay.expert_groups() == g.expert == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.expert_replica == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.of("expert_replica", 6) == [0, 2, 4, 6] and g.index("expert", 6) == 3 and lay.expert_partition(6) == 0


def test_defaults_are_pure_data_parallel():
    lay = Layout(4)
    assert (lay.sequence, lay.expert, lay.vocab) == (1, 1, 1)
    assert LayoutGroups(lay).sequence == [[0], [1], [2], [3]]
    assert LayoutGroups(lay).expert_replica == [[0, 1, 2, 3]]


def test_non_divisor_message():
    with pytest.raises(LayoutError) as e:
        Layout(4, expert=3)
    assert str(e.value) == "parallel.expert=3 does not divide the world size 4; choose a divisor of 4: 1, 2, 4"


@pytest.mark.parametrize("setting", ["sequence", "expert", "vocab"])
@pytest.mark.parametrize("bad", [0, -2, 5, 12, True, 2.0, "2", None])
def test_impossible_settings_name_the_setting(setting, bad):
    with pytest.raises(LayoutError, match=rf"^parallel\.{setting}=.*choose a divisor of 4: 1, 2, 4$"):
        Layout(4, **{setting: bad})


@given(st.integers(1, 100), st.integers(-5, 200), st.sampled_from(["sequence", "expert", "vocab"]))
def test_any_non_divisor_is_rejected(world, n, setting):
    if n >= 1 and world % n == 0:
        check_layout(Layout(world, **{setting: n}))
    else:
        with pytest.raises(LayoutError, match=rf"^parallel\.{setting}={n} "):
            Layout(world, **{setting: n})


@pytest.mark.parametrize("world", [0, -1, 2.0])
def test_bad_world(world):
    with pytest.raises(LayoutError, match="world size"):
        Layout(world)


def test_layout_error_is_value_error_and_layout_is_frozen():
    assert issubclass(LayoutError, ValueError)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout(2).expert = 2  # type: ignore[misc]
    assert Layout(4, 2, 2, 1) == Layout(4, 2, 2, 1)  # value semantics: usable as a dict key


@pytest.mark.parametrize("rank", [-1, 4, 1.0])
def test_rank_out_of_range(rank):
    with pytest.raises(ValueError, match="outside the world of 4"):
        Layout(4, 2).expert_partition(rank)


def test_backend_for_device():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="meta"):
        backend_for(torch.device("meta"))


def test_device_for():
    expected = torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu")
    assert device_for(1) == expected


def test_torchrun_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "OTHER": "x"}
    assert TorchrunEnv.from_environ(env) == TorchrunEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE not set: launch distributed runs with torchrun"):
        TorchrunEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_set_rank_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("os.cpu_count", lambda: 16)
        assert set_rank_threads(4) == 4 and torch.get_num_threads() == 4
        assert set_rank_threads(32) == 1 and torch.get_num_threads() == 1  # never zero threads
    finally:
        torch.set_num_threads(before)
