"""Ulysses attention on D gloo ranks against the single-process attention: outputs and gradients.

Every rank builds the same weights and the same full input from one seed, keeps its slice of the
sequence, and runs the attention block with the Ulysses core; the parent compares each rank's
output slice and input-gradient slice with the reference, and the sum of the ranks' weight
gradients with the reference weight gradients.
"""

import itertools

import pytest
import torch
from torch.testing import assert_close

from mop.models.attention import Attention, AttentionCore
from mop.models.config import ModelConfig
from mop.models.documents import Documents
from mop.models.families import family_of, model_spec
from mop.models.transformer import document_positions
from mop.parallel import DistLayout, Layout
from mop.parallel.ulysses import UlyssesAttention, head_plan, kv_index
from mop.testing import rank_device, run_distributed
from conftest import devices, to_cpu

BATCH, SEQ = 2, 16


def cases(world):
    """(heads, kv_heads, head chunks, packed documents); 12 heads over 3 KV heads on 2 ranks splits a
    KV group between ranks (the index_select path)."""
    aligned = [(8, *case) for case in itertools.product([1, 2, 4], [1, 2], [False, True])]
    return aligned + ([(12, 3, 1, True), (12, 3, 2, False)] if world == 2 else [])


def attention_case(heads, kv_heads, packed):
    cfg = ModelConfig(hidden=32, heads=heads, kv_heads=kv_heads, head_dim=8)
    attention = Attention(cfg)
    torch.manual_seed(kv_heads)
    for name, param in attention.named_parameters():
        torch.nn.init.normal_(param, mean=1.0 if param.dim() == 1 else 0.0, std=0.2)
    g = torch.Generator().manual_seed(100 + kv_heads)
    x = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
    upstream = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
    documents = None
    if packed:
        documents = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 11 + [1] * 5])
    positions = document_positions(documents) if packed else torch.arange(SEQ).expand(BATCH, SEQ)
    return attention, x, upstream, documents, positions


def run_case(attention, x, upstream, documents, positions, rows=slice(None)):
    x = x[:, rows].clone().requires_grad_()
    out = attention(x, positions[:, rows], None if documents is None else Documents.from_ids(documents))
    (out * upstream[:, rows]).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in attention.named_parameters()}


def ulysses_cases(rank, world):
    device = rank_device()
    layout = DistLayout(Layout(world, sequence=world), device)
    results = []
    for heads, kv_heads, chunks, packed in cases(world):
        attention, *tensors = attention_case(heads, kv_heads, packed)
        attention.to(device).core = UlyssesAttention(layout.sequence_group, heads, kv_heads, chunks)
        tokens = SEQ // world
        x, upstream, documents, positions = (t.to(device) if t is not None else None for t in tensors)
        results.append(to_cpu(run_case(attention, x, upstream, documents, positions,
                                       slice(rank * tokens, (rank + 1) * tokens))))
    return results


@pytest.mark.parametrize("device", devices(4))
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ulysses_matches_single_process_attention(world, device):
    per_rank = run_distributed(ulysses_cases, world, device=device)
    for case, (heads, kv_heads, chunks, packed) in enumerate(cases(world)):
        label = f"D={world} heads={heads} kv_heads={kv_heads} chunks={chunks} packed={packed}"
        check_against_single_process([results[case] for results in per_rank],
                                     run_case(*attention_case(heads, kv_heads, packed)), label)


def check_against_single_process(per_rank, single, label):
    """Each rank's output and input gradient are its slice of the single process's; the ranks'
    weight gradients sum to its."""
    out, x_grad, weight_grads = single
    tokens = out.shape[1] // len(per_rank)
    for rank, (rank_out, rank_x_grad, _) in enumerate(per_rank):
        rows = slice(rank * tokens, (rank + 1) * tokens)
        assert_close(rank_out, out[:, rows], atol=1e-5, rtol=1e-5, msg=f"output {label}")
        assert_close(rank_x_grad, x_grad[:, rows], atol=1e-5, rtol=1e-5, msg=f"input grad {label}")
    for name, grad in weight_grads.items():
        summed = sum(grads[name] for _, _, grads in per_rank)
        assert_close(summed, grad, atol=1e-5, rtol=1e-5, msg=f"{name} grad {label}")


def test_each_kv_head_is_sent_only_where_it_is_read():
    # kv_heads >= D: each rank receives its own KV heads, once.
    (plan,) = head_plan(heads=8, kv_heads=4, ranks=2, chunks=1)
    assert plan.query == [(0, 4), (4, 8)] and plan.kv == [(0, 2), (2, 4)]
    # kv_heads < D: the one KV head a rank reads, replicated to the D / kv_heads ranks sharing it.
    (plan,) = head_plan(heads=8, kv_heads=2, ranks=4, chunks=1)
    assert plan.kv == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Misaligned groups (12 heads, 3 KV heads, D=2): rank 0 reads KV 0-1, rank 1 reads KV 1-2.
    (plan,) = head_plan(heads=12, kv_heads=3, ranks=2, chunks=1)
    assert plan.kv == [(0, 2), (1, 3)]
    assert kv_index(plan.query[0], plan.kv[0], group=4).tolist() == [0, 0, 0, 0, 1, 1]
    assert kv_index((0, 4), (0, 2), group=2) is None


WIDE_V = [(chunks, packed) for chunks in (1, 2) for packed in (False, True)]  # q/k width 8, v width 12


def wide_v_case(packed):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(BATCH, SEQ, heads, width, generator=g) for heads, width in ((8, 8), (2, 8), (2, 12)))
    upstream = torch.randn(BATCH, SEQ, 8, 12, generator=g)
    documents = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 11 + [1] * 5]) if packed else None
    return q, k, v, upstream, documents


def run_core(core, q, k, v, upstream, documents, rows=slice(None)):
    q, k, v = (t[:, rows].clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, None if documents is None else Documents.from_ids(documents))
    (out * upstream[:, rows]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def wide_v_cases(rank, world):
    device = rank_device()
    layout = DistLayout(Layout(world, sequence=world), device)
    tokens = SEQ // world
    return [to_cpu(run_core(UlyssesAttention(layout.sequence_group, 8, 2, chunks),
                            *(t.to(device) if t is not None else None for t in wide_v_case(packed)),
                            slice(rank * tokens, (rank + 1) * tokens)))
            for chunks, packed in WIDE_V]


@pytest.mark.parametrize("device", devices(2))
def test_ulysses_sends_values_wider_than_queries_and_keys_at_their_own_width(device):
    per_rank = run_distributed(wide_v_cases, 2, device=device)
    tokens = SEQ // 2
    for case, (chunks, packed) in enumerate(WIDE_V):
        reference = run_core(AttentionCore(), *wide_v_case(packed))
        for rank, results in enumerate(per_rank):
            rows = slice(rank * tokens, (rank + 1) * tokens)
            for name, got, want in zip(("output", "q grad", "k grad", "v grad"), results[case], reference):
                assert_close(got, want[:, rows], atol=1e-5, rtol=1e-5, msg=f"{name} chunks={chunks} packed={packed}")


# Each family's own attention under Ulysses: latent attention (its own softmax scale, v narrower than
# q/k), gpt-oss's sinks (a per-head value the core takes) in a sliding-window block (window 3 < the
# documents) and a full one; head chunks 1 and 2, packed and not.
FAMILY_CASES = [(family, layer, chunks, packed) for family, layer in (("deepseek_v3", 0), ("gpt_oss", 0), ("gpt_oss", 1))
                for chunks in (1, 2) for packed in (False, True)]
FAMILY_CONFIGS = {
    "deepseek_v3": dict(heads=4, kv_heads=4, head_dim=12, options={
        "q_lora_rank": 8, "kv_lora_rank": 10, "qk_rope_head_dim": 4, "v_head_dim": 6, "yarn_factor": 4.0,
        "yarn_original_context": 4, "yarn_mscale_all_dim": 1.0}),
    "gpt_oss": dict(heads=4, kv_heads=2, head_dim=8, options={"sliding_window": 3}),
}


def family_attention_case(family, layer, packed):
    cfg = ModelConfig(family=family, hidden=32, qk_norm=False, **FAMILY_CONFIGS[family])
    attention = family_of(cfg).attention(cfg, layer)
    torch.manual_seed(layer)
    for param in attention.parameters():
        torch.nn.init.normal_(param, mean=1.0 if param.dim() == 1 else 0.0, std=0.2)
    g = torch.Generator().manual_seed(3)
    x, upstream = torch.randn(BATCH, SEQ, cfg.hidden, generator=g), torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
    documents = torch.tensor([[0] * 3 + [1] * 6 + [2] * 7, [0] * 11 + [1] * 5]) if packed else None
    positions = document_positions(documents) if packed else torch.arange(SEQ).expand(BATCH, SEQ)
    return attention, x, upstream, documents, positions


def family_cases(rank, world):
    layout = DistLayout(Layout(world, sequence=world), torch.device("cpu"))
    tokens = SEQ // world
    results = []
    for family, layer, chunks, packed in FAMILY_CASES:
        attention, *tensors = family_attention_case(family, layer, packed)
        spec = model_spec(ModelConfig(family=family, hidden=32, qk_norm=False, **FAMILY_CONFIGS[family])).attention
        attention.core = UlyssesAttention(layout.sequence_group, spec.heads, spec.kv_heads, chunks, attention.core)
        results.append(run_case(attention, *tensors, slice(rank * tokens, (rank + 1) * tokens)))
    return results


def test_each_familys_attention_under_ulysses_matches_single_process():
    per_rank = run_distributed(family_cases, 2)
    for case, (family, layer, chunks, packed) in enumerate(FAMILY_CASES):
        check_against_single_process([results[case] for results in per_rank],
                                     run_case(*family_attention_case(family, layer, packed)),
                                     f"{family} layer {layer} chunks={chunks} packed={packed}")
