"""The skewed routing `mop bench moe` runs: what its scenarios realise (no processes)."""

from mop.testing.routing import skewed_routing


def hot_share(scenario, experts, top_k, tokens=2000):
    expert_ids, _ = skewed_routing(scenario, tokens, experts, top_k, seed=0)
    assert all(len(set(row)) == top_k for row in expert_ids.tolist())  # k distinct experts per token
    return float((expert_ids < scenario[2]).float().mean())


def test_a_token_holds_at_most_one_assignment_per_hot_expert():
    # "95% -> 1" at k = 4: one hot expert can take at most one of a token's 4 slots.
    assert 0.2 < hot_share(("95% -> 1", 0.95, 1), experts=16, top_k=4) <= 0.25


def test_a_scenario_with_enough_hot_experts_realises_its_share():
    assert abs(hot_share(("95% -> 16", 0.95, 16), experts=32, top_k=2) - 0.95) < 0.03
    assert hot_share(("balanced", 0.0, 0), experts=32, top_k=2) == 0.0
