"""Each expert's load in the records (issue 49, `mop.metrics.expert_load`, `DeadExperts`,
`expert_shares`): the summaries of a step's global expert counts and router entropy, the experts
that stay dead over a window with one warning line when they join, the per-layer shares as
TensorBoard histograms, and the same records whatever the layout (the counts and entropy sums ride
the step's one reduction of its loss parts)."""

from __future__ import annotations

import math

import pytest
import torch
from test_train import run

from mop.metrics import DeadExperts, expert_load, expert_shares


def test_the_load_summaries_of_a_steps_counts():
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    load = expert_load(counts)
    assert load["experts/load_max_over_mean"] == 2.0 and load["experts/idle"] == 1
    layer_0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)) / math.log(4)  # 0.75
    assert load["experts/load_entropy"] == pytest.approx((layer_0 + 1.0) / 2, rel=1e-12)
    assert expert_load(None) == {} and "experts/router_entropy" not in load
    # top-2: layer 0's 3 tokens at 0.5 log 4 of router entropy each on average, layer 1's routers certain
    entropy_sums = torch.tensor([1.5 * math.log(4), 0.0], dtype=torch.float64)
    with_router = expert_load(counts[:, :3] * torch.tensor([[1.0], [0.5]]), entropy_sums, 2)
    assert with_router["experts/router_entropy"] == pytest.approx((0.5 * math.log(4) / math.log(3)) / 2, rel=1e-12)
    shares = expert_shares(counts, first_layer=1)
    assert sorted(shares) == ["experts/layer_1", "experts/layer_2"] and shares["experts/layer_1"].tolist() == [
        0.5, 0.0, 0.25, 0.25]


def test_experts_that_stay_dead_over_the_window_are_counted_and_said_once():
    dead = DeadExperts(window=3, first_layer=1)
    quiet = torch.tensor([[3.0, 0.0, 1.0], [1.0, 1.0, 2.0]])
    assert dead.update(quiet) == ({}, None) and dead.update(quiet) == ({}, None)  # the window is not full yet
    record, warning = dead.update(quiet)
    assert record == {"experts/dead": 1} and "1 expert(s) got no token in the last 3 steps" in warning
    assert "layer 1 expert 1" in warning
    assert dead.update(quiet) == ({"experts/dead": 1}, None)  # still dead: said once
    woken = torch.tensor([[3.0, 2.0, 1.0], [1.0, 0.0, 2.0]])
    record, warning = dead.update(woken)
    assert record == {"experts/dead": 0} and warning is None  # expert 1 of layer 1 took tokens in the window
    dead.update(woken)
    record, warning = dead.update(woken)
    assert record == {"experts/dead": 1} and "layer 2 expert 1" in warning
    assert DeadExperts(window=0, first_layer=0).update(quiet) == ({}, None)


EXPERTS = ("experts/load_max_over_mean", "experts/load_entropy", "experts/idle")


@pytest.mark.slow
def test_the_expert_load_is_the_same_in_the_mop_layout(tmp_path):
    reference = run(tmp_path, "reference", "--train.steps=3")
    records = run(tmp_path, "mop", "--train.steps=3", "--parallel.strategy=mop", "--parallel.nproc=2",
                  "--parallel.expert=2", "--parallel.expert_balance=llep", "--parallel.sequence=2")
    for mine, theirs in zip(records, reference):
        assert [mine[k] for k in EXPERTS] == pytest.approx([theirs[k] for k in EXPERTS], rel=1e-12)
        # each token's fp32 router entropy is the reference's; the ranks sum them in another order
        assert mine["experts/router_entropy"] == pytest.approx(theirs["experts/router_entropy"], rel=1e-6)


def test_the_records_and_tensorboard_hold_the_expert_load(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run(tmp_path, "run", "--train.steps=2", "--log.tensorboard=true", "--log.dead_expert_window=1")
    assert all(set(EXPERTS) | {"experts/dead", "experts/router_entropy"} <= set(r) for r in records)
    assert all(r["experts/load_max_over_mean"] >= 1 and 0 < r["experts/load_entropy"] <= 1 for r in records)
    assert all(0 < r["experts/router_entropy"] <= 1 for r in records)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert {"experts/layer_0", "experts/layer_1"} <= set(events.Tags()["histograms"])
    assert "experts/load_entropy" in events.Tags()["scalars"]
