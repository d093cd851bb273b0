"""The routers against transformers' own: the same experts chosen with the same weights, fp32."""

import pytest
import torch
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.moe import GroupLimitedSigmoidRouter

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("experts, groups, groups_per_token, top_k, norm, scaling", [
    (8, 1, 1, 2, True, 1.0), (16, 4, 2, 3, True, 2.5), (16, 8, 3, 4, False, 1.5), (12, 3, 1, 2, True, 1.0)])
def test_group_limited_sigmoid_router_chooses_and_weighs_like_deepseek_v3(experts, groups, groups_per_token, top_k,
                                                                         norm, scaling):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden = 16
    theirs = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=hidden, n_routed_experts=experts, n_group=groups, topk_group=groups_per_token,
        num_experts_per_tok=top_k, norm_topk_prob=norm, routed_scaling_factor=scaling))
    g = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(experts, hidden, generator=g))
        theirs.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    mine = GroupLimitedSigmoidRouter(ModelConfig(hidden=hidden, experts=experts, top_k=top_k, norm_topk_prob=norm),
                                     groups, groups_per_token, scaling)
    with torch.no_grad():
        mine.weight.copy_(theirs.weight)
        mine.score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, hidden, generator=g)

    _, their_weights, their_ids = theirs(x)
    scores, weights, ids, _ = mine(x)
    # both take top-k unsorted or sorted: compare each token's (expert, weight) pairs in expert order
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, order), their_ids.gather(-1, their_order))
    assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order), rtol=0, atol=0)
    assert_close(scores.sum(-1), torch.ones(64))
