"""Routing replay (issue 47) on one process: a replayed selection runs exactly the recorded experts,
weighed by the router's live scores (so the router keeps its gradient), replaying what the model
chose itself changes nothing (bit for bit, every family), and a checkpointed block's recomputation
replays the same experts as its forward."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mop.models.families import FAMILIES
from mop.models.moe import MoE
from mop.models.transformer import build_model
from mop.parallel.checkpointing import apply_activation_checkpointing
from tests.test_family_contract import small

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def own_routes(model, input_ids) -> torch.Tensor:
    """`[B, S, moe_layers, k]`: the experts each MoE layer's router chooses itself (its 4th output)."""
    chosen, hooks = [], []
    for module in model.modules():
        if isinstance(module, MoE):
            hooks.append(module.router.register_forward_hook(lambda m, args, out: chosen.append(out[3])))
    with torch.no_grad():
        model(input_ids)
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).view(*input_ids.shape, len(chosen), -1)


def tokens(cfg, batch=2, seq=12, seed=0):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_the_models_own_routes_changes_nothing(family):
    cfg = small(family)
    model = build_model(cfg, seed=3)
    ids = tokens(cfg)
    labels = ids.roll(-1, 1)
    routes = own_routes(model, ids)
    free = model.policy_terms(ids, labels)
    replayed = model.policy_terms(ids, labels, routes=routes)
    assert torch.equal(free.logps, replayed.logps)
    assert torch.equal(free.entropy, replayed.entropy)
    assert torch.equal(free.expert_stats, replayed.expert_stats)
    assert free.replay is None
    moe_layers = cfg.layers - cfg.dense_layers
    expected = torch.tensor([[0.0, ids.numel()]] * moe_layers, dtype=torch.float64)
    assert torch.equal(replayed.replay, expected)


def other_routes(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's selection moved to other experts (a cyclic shift: still k distinct experts)."""
    return (routes + 1) % experts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_runs_the_recorded_experts_weighed_by_the_live_router(family):
    """The MoE layer under replay equals its experts run on the recorded selection with the router's
    weights for it recomputed by hand (each family's rule), outputs and gradients, the router's
    included (a forced gather that dropped the router's gradient would fail here)."""
    cfg = small(family)
    layer = next(m for m in build_model(cfg, seed=5).modules() if isinstance(m, MoE))
    x = torch.randn(2, 6, cfg.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    routes = other_routes(layer.router(x.detach().view(-1, cfg.hidden))[3], cfg.experts).view(2, 6, -1)
    routes[1, 4:] = -1  # two tokens without a recorded selection route themselves
    out, stats = layer(x, routes=routes)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.clone() for p in (x, layer.router.weight)]
    mismatched, replayed = stats.replay.tolist()
    assert (mismatched, replayed) == (10, 10)

    x.grad, layer.router.weight.grad = None, None
    flat = x.view(-1, cfg.hidden)
    _, _, own_ids, own = layer.router(flat)
    forced = routes.view(-1, cfg.top_k)
    chosen = torch.where(forced[:, :1] >= 0, forced, own)
    weights = by_hand_weights(layer.router, flat, chosen, cfg)
    expected = layer.experts(flat, chosen, weights) + (layer.shared(flat) if layer.shared is not None else 0)
    assert_close(out.view(-1, cfg.hidden), expected, rtol=1e-6, atol=1e-6)
    (expected.view_as(out) * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    assert_close(grads[0], x.grad, rtol=1e-5, atol=1e-6)
    assert_close(grads[1], layer.router.weight.grad, rtol=1e-5, atol=1e-6)
    assert grads[1].abs().sum() > 0


def by_hand_weights(router, flat, chosen, cfg) -> torch.Tensor:
    """Each family's routing weights for a given selection, written out from its published rule."""
    logits = flat @ router.weight.t()
    if hasattr(router, "bias") and isinstance(router.bias, torch.nn.Parameter):  # gpt-oss: softmax over the k logits
        return torch.softmax((logits + router.bias).gather(-1, chosen), -1)
    if hasattr(router, "score_correction_bias"):  # DeepSeek-V3 / GLM-4.5: live sigmoid scores, no bias
        picked = logits.float().sigmoid().gather(-1, chosen)
        if router.norm_topk_prob:
            picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
        return picked * router.scaling
    picked = logits.float().softmax(-1).gather(-1, chosen)
    return picked / picked.sum(-1, keepdim=True) if cfg.norm_topk_prob else picked


def test_checkpoint_recompute_replays_the_same_experts():
    """Under activation checkpointing every MoE layer's experts run twice (forward, recomputation),
    both times on the replayed selection."""
    cfg = small("qwen3_moe")
    model = build_model(cfg, seed=7)
    ids = tokens(cfg)
    routes = other_routes(own_routes(model, ids), cfg.experts)
    apply_activation_checkpointing(model, offload=False, pin_memory=False)
    seen = []
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    terms = model.policy_terms(ids, ids.roll(-1, 1), routes=routes)
    assert len(seen) == cfg.layers
    terms.logps.sum().backward()
    assert len(seen) == 2 * cfg.layers
    for layer in range(cfg.layers):
        wanted = routes[:, :, layer].reshape(-1, cfg.top_k)
        assert torch.equal(seen[layer], wanted)  # the forward
        assert torch.equal(seen[cfg.layers + cfg.layers - 1 - layer], wanted)  # the recomputation, backwards
