"""The placement record (`mop.parallel.placement`): every rank holds one piece of every parameter,
the categories are the spec's, and the shard sizes are the ones the run allocates."""

import itertools
import math

import pytest

from mop.models.config import ModelConfig
from mop.models.families import model_spec
from mop.parallel.placement import placements

MODEL = ModelConfig(vocab_size=259, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=8,
                    expert_intermediate=16, dense_layers=1, shared_expert_intermediate=8)


@pytest.mark.parametrize("world, expert, vocab", [(1, 1, 1), (2, 2, 2), (4, 2, 4), (4, 4, 1), (8, 2, 4)])
def test_every_rank_holds_one_piece_of_every_parameter(world, expert, vocab):
    record = placements(MODEL, world, expert, vocab)
    for name, place in record.items():
        assert place.partitions * place.fsdp_ranks * place.replicas == world, name
        # The pieces cover the rows: partitions x FSDP shards of at most local_rows rows each.
        assert place.partitions * place.fsdp_ranks * place.local_rows >= place.shape[0], name
        assert place.local_rows * place.fsdp_ranks < -(-place.shape[0] // place.partitions) + place.fsdp_ranks, name
        assert (place.replicas > 1) == (name == "lm_head.weight" and vocab > 1 and world > vocab), name
        assert (place.gradient == "none") == (place.fsdp_ranks == 1 and place.replicas == 1), name


def test_the_categories_are_the_specs():
    counts = dict.fromkeys(("dense", "expert", "vocabulary"), 0)
    for place in placements(MODEL, 4, 2, 2).values():
        counts[place.category] += math.prod(place.shape)
    assert counts == model_spec(MODEL).parameters()


def test_experts_and_the_vocabulary_shard_where_the_layout_puts_them():
    for world, expert, vocab in itertools.product([4], [1, 2, 4], [1, 2, 4]):
        record = placements(MODEL, world, expert, vocab)
        experts = record["layers.1.mlp.experts.w_gate_up"]
        assert (experts.partitions, experts.fsdp_ranks) == (expert, world // expert)
        assert experts.fsdp_group == ("expert_replica" if expert > 1 else "world")
        head = record["lm_head.weight"]
        assert (head.fsdp_group, head.partitions, head.local_rows) == (
            ("", vocab, -(-259 // vocab)) if vocab > 1 else ("world", 1, -(-259 // world)))
        assert record["embed.weight"].fsdp_group == "world" and record["embed.weight"].category == "vocabulary"
