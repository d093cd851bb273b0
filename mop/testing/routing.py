"""Skewed routing for the expert-layer benchmark and its tests: the LLEP paper's "x% of the
token-expert assignments into n hot experts", realised by a router that picks k distinct experts per
token (so with n < k hot experts at most n of a token's k assignments can be hot)."""

from __future__ import annotations

import torch

# (name, share of assignments aimed at the hot experts, number of hot experts 0..n-1)
SCENARIOS = [("balanced", 0.0, 0)] + [(f"{int(p * 100)}% -> {n}", p, n) for n in (1, 4, 16) for p in (0.3, 0.5, 0.8, 0.95)]


def skewed_routing(scenario: tuple, tokens: int, experts: int, top_k: int, seed: int):
    """Expert ids `[tokens, k]` (distinct per token) and routing weights for one rank."""
    _, hot_share, hot = scenario
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    if hot:
        # A hot pick outranks every uniform one: with probability hot_share per slot, the slot's
        # expert is one of the hot experts (evenly), as the paper's "x% into n experts".
        boost = (torch.rand(tokens, top_k, generator=g) < hot_share)
        for slot in range(top_k):
            chosen = torch.randint(0, hot, (tokens,), generator=g)
            scores[torch.arange(tokens)[boost[:, slot]], chosen[boost[:, slot]]] += 2.0 + slot
    expert_ids = scores.topk(top_k, dim=-1).indices
    return expert_ids, torch.rand(tokens, top_k, generator=g)
