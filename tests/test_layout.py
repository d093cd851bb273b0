"""Rank arithmetic of ``mop.parallel.Layout`` and the process-setup helpers; no processes."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mop.parallel import Layout, LayoutError, TorchrunEnv, backend_for, device_for, set_rank_threads

WORLDS = [1, 2, 3, 4, 6, 8, 12, 16, 64]


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(lay: Layout) -> None:
    """Every invariant of the module docstring, for one layout."""
    w = lay.world
    seqs, experts, expert_reps = lay.sequence_groups(), lay.expert_groups(), lay.expert_replica_groups()
    vocabs, vocab_reps = lay.vocab_groups(), lay.vocab_replica_groups()
    families = {
        "sequence": (seqs, lay.sequence, "block"),
        "expert": (experts, lay.expert, "block"),
        "expert_replica": (expert_reps, lay.expert, "replica"),
        "vocab": (vocabs, lay.vocab, "block"),
        "vocab_replica": (vocab_reps, lay.vocab, "replica"),
    }
    for name, (groups, n, kind) in families.items():
        # A partition: every rank exactly once.
        assert sorted(r for g in groups for r in g) == list(range(w)), name
        for i, g in enumerate(groups):
            if kind == "block":
                assert g == list(range(i * n, (i + 1) * n)), name  # contiguous, in order
            else:
                assert g == list(range(i, w, n)), name  # strided by n, partition i
        assert len(groups) == (w // n if kind == "block" else n), name

    assert lay.data_parallel == len(seqs)
    assert lay.expert_replicas == len(expert_reps[0]) == w // lay.expert
    assert lay.vocab_replicas == len(vocab_reps[0]) == w // lay.vocab

    for r in range(w):
        seq = lay.sequence_group_of(r)
        assert seq == seqs[lay.data_index(r)]
        assert seq.index(r) == lay.sequence_index(r)

        eg, er = lay.expert_group_of(r), lay.expert_replica_group_of(r)
        assert eg == experts[lay.expert_group_index(r)]
        assert eg.index(r) == lay.expert_partition(r)
        assert er == expert_reps[lay.expert_partition(r)]
        assert er.index(r) == lay.expert_group_index(r)  # the FSDP shard index of the partition
        assert all(lay.expert_partition(q) == lay.expert_partition(r) for q in er)
        assert set(eg) & set(er) == {r}  # block x replica is a grid: they meet only at r

        vg, vr = lay.vocab_group_of(r), lay.vocab_replica_group_of(r)
        assert vg == vocabs[lay.vocab_group_index(r)]
        assert vg.index(r) == lay.vocab_shard(r)
        assert vr == vocab_reps[lay.vocab_shard(r)]
        assert vr.index(r) == lay.vocab_group_index(r)
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
    assert lay.sequence_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.data_parallel == 2
    assert [lay.data_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.expert_groups() == [list(range(8))]
    assert lay.expert_replica_groups() == [[r] for r in range(8)]
    assert [lay.expert_partition(r) for r in range(8)] == list(range(8))
    assert lay.vocab_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.vocab_replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.vocab_replica_group_of(5) == [1, 3, 5, 7]


def test_expert_replicas_shard_one_partition():
    lay = Layout(world=8, expert=2)
    assert lay.expert_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.expert_replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.expert_replica_group_of(6) == [0, 2, 4, 6] and lay.expert_group_index(6) == 3


def test_defaults_are_pure_data_parallel():
    lay = Layout(4)
    assert (lay.sequence, lay.expert, lay.vocab) == (1, 1, 1)
    assert lay.sequence_groups() == [[0], [1], [2], [3]]
    assert lay.expert_replica_groups() == [[0, 1, 2, 3]]


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
        Layout(4, 2).sequence_group_of(rank)


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
