"""The single-device MoE model: experts, routing, packed documents, losses, initialisation."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.moe import Experts, RouterStats, grouped_gemm_applies, load_balancing_loss, swiglu_experts
from mop.models.transformer import IGNORE_INDEX, build_model, document_positions, parameter_seed

TINY = ModelConfig(vocab_size=97, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
                   expert_intermediate=24, dense_intermediate=40)


def naive_experts(experts: Experts, x, expert_ids, weights):
    """Token by token, expert by expert: the definition the grouped computation must reproduce."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(expert_ids.shape[1]):
            e = expert_ids[t, j]
            gate, up = (experts.w_gate_up[e] @ x[t]).chunk(2)
            acc = acc + weights[t, j] * (experts.w_down[e] @ (F.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_experts_match_the_per_token_definition(top_k):
    # float64: this checks the grouping arithmetic itself, so only summation order may differ.
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, experts=6, top_k=top_k)
    experts = Experts(cfg).double()
    torch.nn.init.normal_(experts.w_gate_up, std=0.3)
    torch.nn.init.normal_(experts.w_down, std=0.3)
    x = torch.randn(11, cfg.hidden, dtype=torch.float64, requires_grad=True)
    # Experts 4 and 5 receive no token: empty groups must be skipped, not break the GEMMs.
    expert_ids = torch.stack([torch.randperm(4)[:top_k] for _ in range(11)])
    weights = torch.rand(11, top_k, dtype=torch.float64, requires_grad=True)
    out = experts(x, expert_ids, weights)
    ref = naive_experts(experts, x, expert_ids, weights)
    assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), [x, weights, experts.w_gate_up, experts.w_down])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, weights, experts.w_gate_up, experts.w_down])
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert grads[2][4:].abs().sum() == 0


def test_document_positions_restart_at_each_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_packed_documents_do_not_see_each_other():
    model = build_model(TINY, seed=1)
    a, b = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 5))
    packed = torch.cat([a, b], dim=1)
    document_ids = torch.tensor([[0] * 7 + [1] * 5])
    logits = model(packed, document_ids=document_ids)
    assert_close(logits[:, :7], model(a), atol=1e-5, rtol=1e-5)
    assert_close(logits[:, 7:], model(b), atol=1e-5, rtol=1e-5)
    # Without document ids the second document attends to the first, so the logits differ.
    assert not torch.allclose(model(packed)[:, 7:], model(b), atol=1e-3)


def _batch(seed, batch=4, seq=16, vocab=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX
    return ids[:, :-1], labels


def test_micro_batched_objective_equals_the_full_batch_loss():
    model = build_model(TINY, seed=2)
    ids, labels = _batch(3)
    full = model(ids, labels)
    full_grads = torch.autograd.grad(full, list(model.parameters()))
    targets = int((labels != IGNORE_INDEX).sum())
    parts = [model.objective(model.loss_terms(ids[i:i + 2], labels[i:i + 2]), targets, 4) for i in (0, 2)]
    assert_close(sum(parts), full, atol=1e-6, rtol=1e-6)
    part_grads = torch.autograd.grad(sum(parts), list(model.parameters()))
    for got, want in zip(part_grads, full_grads):
        assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_cross_entropy_part_is_the_mean_over_targets():
    cfg = dataclasses.replace(TINY, aux_loss_coef=0.0)
    model = build_model(cfg, seed=2)
    ids, labels = _batch(4)
    logits = model(ids)
    expected = F.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    assert_close(model(ids, labels), expected)


def test_load_balancing_loss_is_top_k_when_routing_is_balanced():
    experts, top_k, tokens = 4, 2, 8
    stats = RouterStats(torch.full((1, experts), tokens * top_k / experts), torch.full((1, experts), tokens / experts),
                        torch.tensor([float(tokens)]))
    assert_close(load_balancing_loss(stats), torch.tensor(float(top_k)))


def test_init_depends_on_seed_and_name_only():
    a, b, c = build_model(TINY, seed=5), build_model(TINY, seed=5), build_model(TINY, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    # A deeper model shares the first layers' values: init does not depend on the module count.
    deeper = build_model(dataclasses.replace(TINY, layers=3), seed=5)
    assert torch.equal(deeper.layers[1].attention.q_proj.weight, a.layers[1].attention.q_proj.weight)
    assert parameter_seed(5, "x") != parameter_seed(5, "y")


@pytest.mark.parametrize("variant", [
    {"dense_layers": 1}, {"shared_expert_intermediate": 16}, {"tie_embeddings": True}, {"qk_norm": False},
    {"norm_topk_prob": False}, {"top_k": 1}])
def test_variants_train(variant):
    cfg = dataclasses.replace(TINY, **variant)
    model = build_model(cfg, seed=0)
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
    ids, labels = _batch(7)
    loss = model(ids, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_bfloat16_autocast_runs_close_to_fp32():
    model = build_model(TINY, seed=0)
    ids, labels = _batch(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids, labels)
    assert abs(low.item() - model(ids, labels).item()) < 0.05


def test_grouped_gemm_and_the_expert_loop_are_identical():
    torch.manual_seed(3)
    x = torch.randn(13, 16, requires_grad=True)
    w_gate_up = torch.randn(4, 2 * 8, 16, requires_grad=True)
    w_down = torch.randn(4, 16, 8, requires_grad=True)
    counts = [5, 0, 6, 2]  # an expert with no rows
    assert grouped_gemm_applies(x, w_gate_up, w_down)
    grouped = swiglu_experts(x, counts, w_gate_up, w_down, grouped=True)
    looped = swiglu_experts(x, counts, w_gate_up, w_down, grouped=False)
    assert torch.equal(grouped, looped)
    for a, b in zip(torch.autograd.grad(grouped.square().sum(), [x, w_gate_up, w_down]),
                    torch.autograd.grad(looped.square().sum(), [x, w_gate_up, w_down])):
        assert torch.equal(a, b)
    assert not grouped_gemm_applies(x[:, :15], w_gate_up[:, :, :15], w_down[:, :15])


def test_groups_padded_for_cuda_alignment_give_the_same_outputs_and_gradients():
    """The zero rows that pad each expert's group to an aligned size (as on CUDA) change no result
    (up to the GEMM kernel's summation order, which may follow the group size)."""
    torch.manual_seed(4)
    x = torch.randn(13, 16, requires_grad=True)
    # Weights scaled like a trained layer's (1/sqrt(fan-in)), so values stay O(1) and fp32 tolerances apply.
    w_gate_up = (torch.randn(4, 2 * 8, 16) / 4).requires_grad_()
    w_down = (torch.randn(4, 16, 8) / 8**0.5).requires_grad_()
    counts = [5, 0, 6, 2]
    padded = swiglu_experts(x, counts, w_gate_up, w_down, grouped=True, align=8)
    plain = swiglu_experts(x, counts, w_gate_up, w_down, grouped=True, align=1)
    assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(padded.square().sum(), [x, w_gate_up, w_down]),
                    torch.autograd.grad(plain.square().sum(), [x, w_gate_up, w_down])):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", [dict(grouped=True), dict(grouped=False), dict(grouped=True, align=8)])
def test_the_probe_gives_each_rows_product_and_the_experts_backward_without_the_down_forward(path):
    """`swiglu_experts(probe=g)` returns `<g, expert(x)>` per row, and its backward for row weights w
    is the experts' backward for output gradients `w * g` (chunked LLEP's backward), on the grouped
    GEMM, the expert loop and padded groups. The rows and the probe are views of one wider message,
    as chunked LLEP's backward passes them (16-byte strides)."""
    torch.manual_seed(5)
    message = torch.randn(13, 2 * 16 + 4)
    x, probe = message[:, :16].requires_grad_(), message[:, 16:32]
    w_gate_up = (torch.randn(4, 2 * 8, 16) / 4).requires_grad_()
    w_down = (torch.randn(4, 16, 8) / 8**0.5).requires_grad_()
    counts = [5, 0, 6, 2]
    row_weights = torch.rand(13)
    products = swiglu_experts(x, counts, w_gate_up, w_down, probe=probe, **path)
    y = swiglu_experts(x, counts, w_gate_up, w_down, grouped=True)
    assert products.dtype == torch.float32 and products.shape == (13,)
    assert_close(products, (probe * y).sum(-1), atol=1e-5, rtol=1e-5)
    inputs = [x, w_gate_up, w_down]
    for a, b in zip(torch.autograd.grad(products, inputs, row_weights),
                    torch.autograd.grad(y, inputs, probe * row_weights.unsqueeze(-1))):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    empty = swiglu_experts(x[:0], [0] * 4, w_gate_up, w_down, probe=probe[:0], **path)
    assert empty.shape == (0,) and empty.requires_grad


def test_a_non_finite_gradient_skips_the_update_and_leaves_the_state():
    from mop.config import load_config
    from mop.build import build_optimizer
    from mop.runtime import Runtime

    model = build_model(TINY, seed=0)
    config = load_config(None, ["--optim.offload=false"])  # torch AdamW on the device
    optimizer = build_optimizer(model, config, Runtime(0, 1, torch.device("cpu"), None))
    ids, labels = _batch(9)
    model(ids, labels).backward()
    record = optimizer.step(1.0)
    assert not record["skipped"] and record["grad_norm"] > 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.adamw.state.items()}
    model(ids, labels).backward()
    model.layers[0].attention.q_proj.weight.grad[0, 0] = float("inf")
    record = optimizer.step(1.0)
    assert record["skipped"] and record["grad_norm"] == float("inf")
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.grad is None
    for key, saved in state.items():
        for name, value in saved.items():
            assert torch.equal(optimizer.adamw.state[key][name], value)
