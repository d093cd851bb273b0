"""Packed-document attention against the dense-mask oracle: the single-device kernel and the Ulysses
core (D = 1, 2, 4 gloo ranks, one or two head chunks), outputs and the gradients of q, k and v.

The oracle is SDPA with the dense `[B, 1, S, S]` mask `causal & same_document`, the definition of
packed-document attention; it lives here only, at small S. The layouts cover one-token documents,
a document filling a whole row, documents crossing the Ulysses slice boundaries, runs of
equal-length documents (one batched call) and packs of short ones (one masked call).
"""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mop.models import documents as documents_module
from mop.models.documents import PACK_TOKENS, SHORT_DOCUMENT, Documents, document_attention
from mop.parallel import DistLayout, Layout
from mop.parallel.ulysses import SequenceDocumentBoundaries, UlyssesAttention
from mop.testing import run_distributed

SEQ, HEADS, DIM = 512, 8, 8


def ids_from_lengths(*rows: list[int]) -> torch.Tensor:
    """`[B, S]` document ids (0, 1, ... along each row) from each row's document lengths."""
    out = []
    for lengths in rows:
        assert sum(lengths) == SEQ
        out.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(out)


def random_lengths(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], SEQ
    while left:
        size = int(torch.randint(1, 4, (1,), generator=g)) if torch.rand(1, generator=g) < 0.5 else int(
            torch.randint(1, 300, (1,), generator=g))
        lengths.append(min(size, left))
        left -= lengths[-1]
    return lengths


LAYOUTS = {
    # A whole row one document; one-token documents, then a run of two equal long ones.
    "whole-row+tiny": ids_from_lengths([SEQ], [1] * 40 + [200, 200, 72]),
    # Documents crossing the slice boundaries of D=2 (256) and D=4 (128, 256, 384).
    "crossing-slices": ids_from_lengths([100, 150, 130, 132], [3, 250, 259]),
    # A run of equal documents across the row boundary (one batched call over both rows).
    "run-across-rows": ids_from_lengths([312, 200], [200, 272] + [1] * 40),
    # A pack of short documents across the row boundary (one masked call over both rows).
    "pack-across-rows": ids_from_lengths([480] + [1] * 32, [2] * 20 + [472]),
    **{f"random-{seed}": ids_from_lengths(random_lengths(2 * seed), random_lengths(2 * seed + 1)) for seed in range(3)},
}
CASES = [(layout, kv_heads, chunks) for layout in LAYOUTS for kv_heads in (1, 2, 4) for chunks in (1, 2)]


def dense_oracle(q, k, v, document_ids, scale=None):
    seq = document_ids.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() & (document_ids[:, :, None] == document_ids[:, None, :])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[2] != k.shape[2], scale=scale)
    return out.transpose(1, 2)


def inputs(kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + kv_heads)
    batch = 2
    q = torch.randn(batch, SEQ, HEADS, DIM, generator=g)
    k, v = (torch.randn(batch, SEQ, kv_heads, DIM, generator=g) for _ in range(2))
    upstream = torch.randn(batch, SEQ, HEADS, DIM, generator=g)
    return q, k, v, upstream


def output_and_grads(attend, q, k, v, upstream):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    (out * upstream).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def oracle_case(layout: str, kv_heads: int):
    q, k, v, upstream = inputs(kv_heads)
    return output_and_grads(lambda *t: dense_oracle(*t, LAYOUTS[layout]), q, k, v, upstream)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [1, 2, 4, HEADS])
def test_kernel_matches_the_dense_mask(layout, kv_heads):
    q, k, v, upstream = inputs(kv_heads)
    documents = Documents.from_ids(LAYOUTS[layout])
    got = output_and_grads(lambda *t: document_attention(*t, documents), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle_case(layout, kv_heads)):
        assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {layout} kv_heads={kv_heads}")


def test_one_document_per_row_is_plain_causal_attention():
    assert Documents.from_ids(torch.zeros(2, SEQ, dtype=torch.int32)) is None
    q, k, v, upstream = inputs(2)
    got = output_and_grads(lambda *t: document_attention(*t, None), q, k, v, upstream)
    want = output_and_grads(lambda *t: dense_oracle(*t, torch.zeros(2, SEQ)), q, k, v, upstream)
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_segments_batch_equal_runs_and_pack_short_documents():
    documents = Documents.from_ids(LAYOUTS["whole-row+tiny"])
    shapes = [(s.count, s.length, s.mask is not None) for s in documents.segments]
    runs = Documents.from_ids(LAYOUTS["run-across-rows"]).segments
    packs = Documents.from_ids(LAYOUTS["pack-across-rows"]).segments
    assert [(s.count, s.length, s.mask is not None) for s in runs] == [(1, 312, False), (2, 200, False),
                                                                     (1, 272, False), (1, 40, True)]
    assert [(s.count, s.length, s.mask is not None) for s in packs] == [(1, 480, False), (1, 72, True),
                                                                      (1, 472, False)]
    # The whole row alone; 40 one-token documents in one masked pack; two equal 200-token documents
    # in one batched call; the 72-token tail (short, but alone in its pack: no mask).
    assert shapes == [(1, SEQ, False), (1, 40, True), (2, 200, False), (1, 72, False)]
    assert documents.lengths == (SEQ, *[1] * 40, 200, 200, 72)
    assert documents.cu_seqlens.tolist() == [0, SEQ, *range(SEQ + 1, SEQ + 41), SEQ + 240, SEQ + 440, 2 * SEQ]
    random = Documents.from_ids(LAYOUTS["random-0"])
    for s in random.segments:
        if s.mask is not None:
            assert s.length <= PACK_TOKENS and s.mask.shape == (s.length, s.length)
    assert sum(s.count * s.length for s in random.segments) == 2 * SEQ
    assert any(s.mask is None and s.length >= SHORT_DOCUMENT for s in random.segments)


def test_decreasing_document_ids_are_rejected():
    with pytest.raises(ValueError, match="non-decreasing"):
        Documents.from_ids(torch.tensor([[0, 0, 1, 1, 0]]))


# ---------------------------------------------------------------- branches (a DPO pair's second response)

def branch_rows(*rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, S]` document ids and prefix lengths from each row's (length, prefix) documents."""
    ids, prefixes = [], []
    for documents in rows:
        assert sum(length for length, _ in documents) == SEQ
        lengths = torch.tensor([length for length, _ in documents])
        ids.append(torch.repeat_interleave(torch.arange(len(documents)), lengths))
        prefixes.append(torch.repeat_interleave(torch.tensor([prefix for _, prefix in documents]), lengths))
    return torch.stack(ids), torch.stack(prefixes)


BRANCHES = {
    # prompt 200 + chosen 100 as one document, the rejected 60 tokens sharing the prompt's first 199;
    # then a pair whose rejected response (300) spans two query blocks, after short documents.
    "pairs": branch_rows([(300, 0), (60, 199), (152, 0)], [(2, 0), (1, 0), (9, 0), (100, 0), (300, 99), (100, 0)]),
    # short branches (under SHORT_DOCUMENT) between short documents, which are packed around them
    "short": branch_rows([(3, 0), (40, 0), (30, 20), (5, 0), (5, 3), (429, 0)], [(256, 0), (256, 256)]),
}


BRANCH_CASES = [(layout, kv_heads, chunks) for layout in BRANCHES for kv_heads in (2, HEADS) for chunks in (1, 2)]


def branch_oracle(q, k, v, document_ids, prefix_lengths):
    """The dense mask with each branch's queries also seeing the first `prefix` keys of the document before it."""
    seq = document_ids.shape[1]
    position = torch.arange(seq)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() & (document_ids[:, :, None] == document_ids[:, None, :])
    previous = document_ids[:, :, None] - 1 == document_ids[:, None, :]
    start = torch.stack([torch.searchsorted(row, row) for row in document_ids])  # each key's document start
    within = (position[None, None, :] - start[:, None, :]) < prefix_lengths[:, :, None]
    mask |= previous & within
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@pytest.mark.parametrize("layout", list(BRANCHES))
@pytest.mark.parametrize("kv_heads", [1, 2, HEADS])
def test_branches_match_the_dense_mask(layout, kv_heads):
    """A branch attends to its prefix and to itself (bottom-right causal), never to the rest of the
    document before it; everything else as before: outputs and the gradients of q, k and v."""
    ids, prefixes = BRANCHES[layout]
    q, k, v, upstream = inputs(kv_heads)
    documents = Documents.from_ids(ids, prefixes)
    assert any(s.prefix for s in documents.segments)
    got = output_and_grads(lambda *t: document_attention(*t, documents), q, k, v, upstream)
    want = output_and_grads(lambda *t: branch_oracle(*t, ids, prefixes), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {layout} kv_heads={kv_heads}")


def test_a_branch_computes_what_its_prefix_and_itself_compute_as_one_document():
    """The rejected response shared after prompt+chosen equals prompt+rejected run as its own
    sequence: the outputs of its tokens and the gradients reaching the prompt's keys and values."""
    prompt, chosen, rejected = 150, 90, 272
    ids, prefixes = branch_rows([(prompt + chosen, 0), (rejected, prompt)], [(SEQ, 0)])
    q, k, v, upstream = inputs(2)
    upstream[0, :prompt + chosen] = 0  # only the rejected response's outputs
    shared = output_and_grads(lambda *t: document_attention(*t, Documents.from_ids(ids, prefixes)), q, k, v, upstream)
    alone = [torch.cat([t[:1, :prompt], t[:1, prompt + chosen:]], 1) for t in (q, k, v, upstream)]
    unshared = output_and_grads(lambda *t: document_attention(*t, None), *alone)
    out, dq, dk, dv = shared
    assert_close(out[0, prompt + chosen:], unshared[0][0, prompt:], atol=1e-5, rtol=1e-5)
    assert_close(dq[0, prompt + chosen:], unshared[1][0, prompt:], atol=1e-5, rtol=1e-5)
    for got, want in ((dk, unshared[2]), (dv, unshared[3])):
        assert_close(got[0, :prompt], want[0, :prompt], atol=1e-5, rtol=1e-5)
        assert_close(got[0, prompt + chosen:], want[0, prompt:], atol=1e-5, rtol=1e-5)
        assert torch.count_nonzero(got[0, prompt:prompt + chosen]) == 0  # the chosen response is not seen


@pytest.mark.parametrize("rows, match", [
    ([[(60, 10), (452, 0)]], "does not hold"),  # a row's first document has no document before it
    ([[(20, 0), (40, 30), (452, 0)]], "does not hold"),  # a prefix longer than the document before
])
def test_impossible_branches_are_rejected(rows, match):
    with pytest.raises(ValueError, match=match):
        Documents.from_ids(*branch_rows(*rows))
    ids, prefixes = branch_rows([(100, 0), (412, 50)])
    prefixes[0, 200] = 7
    with pytest.raises(ValueError, match="constant"):
        Documents.from_ids(ids, prefixes)


def _ulysses_cases(rank, world):
    """Each rank holds its slice of both rows: the documents come from the slices' ids, gathered."""
    layout = DistLayout(Layout(world, sequence=world), torch.device("cpu"))
    tokens = SEQ // world
    rows = slice(rank * tokens, (rank + 1) * tokens)
    boundaries = SequenceDocumentBoundaries(layout.sequence_group)
    results = []
    for name, kv_heads, chunks in CASES:
        core = UlyssesAttention(layout.sequence_group, HEADS, kv_heads, chunks)
        documents = boundaries(LAYOUTS[name][:, rows])
        assert documents.lengths == Documents.from_ids(LAYOUTS[name]).lengths
        q, k, v, upstream = (t[:, rows] for t in inputs(kv_heads))
        results.append(output_and_grads(lambda *t: core(*t, documents), q, k, v, upstream))
    for name, kv_heads, chunks in BRANCH_CASES:  # branches: the prefix lengths gathered with the ids
        core = UlyssesAttention(layout.sequence_group, HEADS, kv_heads, chunks)
        ids, prefixes = BRANCHES[name]
        documents = boundaries(ids[:, rows], prefixes[:, rows])
        assert documents.prefixes == Documents.from_ids(ids, prefixes).prefixes
        q, k, v, upstream = (t[:, rows] for t in inputs(kv_heads))
        results.append(output_and_grads(lambda *t: core(*t, documents), q, k, v, upstream))
    return results


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
def test_ulysses_core_matches_the_dense_mask(world):
    per_rank = run_distributed(_ulysses_cases, world)
    tokens = SEQ // world
    for index, (name, kv_heads, chunks) in enumerate(CASES):
        want = oracle_case(name, kv_heads)
        for rank, results in enumerate(per_rank):
            rows = slice(rank * tokens, (rank + 1) * tokens)
            for label, got, full in zip(("out", "dq", "dk", "dv"), results[index], want):
                assert_close(got, full[:, rows], atol=1e-5, rtol=1e-5,
                             msg=f"{label} D={world} {name} kv_heads={kv_heads} chunks={chunks} rank {rank}")
    for index, (name, kv_heads, chunks) in enumerate(BRANCH_CASES, start=len(CASES)):
        want = output_and_grads(lambda *t: branch_oracle(*t, *BRANCHES[name]), *inputs(kv_heads))
        for rank, results in enumerate(per_rank):
            rows = slice(rank * tokens, (rank + 1) * tokens)
            for label, got, full in zip(("out", "dq", "dk", "dv"), results[index], want):
                assert_close(got, full[:, rows], atol=1e-5, rtol=1e-5,
                             msg=f"{label} D={world} {name} kv_heads={kv_heads} chunks={chunks} rank {rank}")


def varlen_stand_in(signature: inspect.Signature):
    """A CPU stand-in for torch's `varlen_attn`: it takes exactly `signature`'s arguments (binding
    raises TypeError where the real call would), refuses unequal head counts without `enable_gqa`
    as torch's does, and values of another width than the queries (flash wants one), and attends
    causally within the cumulative spans by the dense oracle."""

    def kernel(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        q, k, v, cu = given["query"], given["key"], given["value"], given["cu_seq_q"]
        assert given["window_size"] == (-1, 0) and given["max_q"] == int(cu.diff().max())
        if q.shape[1] != k.shape[1] and not given.get("enable_gqa", False):
            raise RuntimeError("varlen_attn: unequal query and key heads need enable_gqa=True")
        if v.shape[-1] != q.shape[-1]:
            raise RuntimeError("varlen_attn: values of another head width than the queries")
        ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff().long()).unsqueeze(0)
        return dense_oracle(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), ids, given.get("scale")).squeeze(0)

    return kernel


def _without(signature: inspect.Signature, name: str) -> inspect.Signature:
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != name])


@pytest.mark.parametrize("kernel", ["this-torch", "without-enable_gqa"])
@pytest.mark.parametrize("kv_heads", [1, 2, HEADS])
def test_varlen_call_fits_the_kernel_signature(monkeypatch, kernel, kv_heads):
    """The flash path's call, run on the CPU through a stand-in with the signature of this torch's
    `varlen_attn` (on the torch 2.11 leg: without `enable_gqa`) and of one without `enable_gqa`:
    the arguments bind, and the K/V heads reach the query heads exactly as the dense mask says."""
    from torch.nn.attention.varlen import varlen_attn

    signature = inspect.signature(varlen_attn)
    stand_in = varlen_stand_in(signature if kernel == "this-torch" else _without(signature, "enable_gqa"))
    monkeypatch.setattr(documents_module, "_varlen_kernel", lambda: stand_in)
    documents_module._varlen_takes.cache_clear()
    try:
        q, k, v, upstream = inputs(kv_heads)
        layout = "crossing-slices"
        documents = Documents.from_ids(LAYOUTS[layout])
        got = output_and_grads(lambda *t: documents_module._varlen(*t, documents, kv_heads != HEADS, None), q, k, v,
                               upstream)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, oracle_case(layout, kv_heads)):
            assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {kernel} kv_heads={kv_heads}")
    finally:
        documents_module._varlen_takes.cache_clear()


@pytest.mark.parametrize("kernel", ["this-torch", "without-scale"])
def test_the_flash_path_pads_narrow_values_and_scales_the_scores(monkeypatch, kernel):
    """Multi-head latent attention's values are narrower than q/k and its softmax scale is its own:
    the flash route pads V to one width and cuts the output back, and passes the scale (or, on a
    kernel without `scale`, pre-scales q); outputs and gradients equal the dense oracle's."""
    from torch.nn.attention.varlen import varlen_attn

    signature = inspect.signature(varlen_attn)
    stand_in = varlen_stand_in(signature if kernel == "this-torch" else _without(signature, "scale"))
    monkeypatch.setattr(documents_module, "_varlen_kernel", lambda: stand_in)
    monkeypatch.setattr(documents_module, "varlen_dtype", lambda q: q.dtype)  # route to flash on the CPU
    documents_module._varlen_takes.cache_clear()
    try:
        q, k, v, upstream = inputs(2)
        v, upstream, scale = v[..., :DIM - 2], upstream[..., :DIM - 2], 0.3
        ids = LAYOUTS["crossing-slices"]
        documents = Documents.from_ids(ids)
        got = output_and_grads(lambda *t: document_attention(*t, documents, scale), q, k, v, upstream)
        want = output_and_grads(lambda *t: dense_oracle(*t, ids, scale), q, k, v, upstream)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {kernel}")
    finally:
        documents_module._varlen_takes.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel needs a GPU")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_varlen_kernel_matches_the_dense_mask(layout, autocast):
    """bf16 flash varlen against the fp32 oracle on the same bf16-rounded inputs: bf16 output
    rounding (2^-8 relative) and bf16 gradient accumulation bound the difference. Under autocast
    the inputs arrive in fp32 (as the reference's q/k norms leave them) and still take varlen."""
    q, k, v, upstream = (t.cuda().bfloat16() for t in inputs(2))
    ids = LAYOUTS[layout].cuda()
    documents = Documents.from_ids(ids)
    assert documents_module.varlen_dtype(q) == torch.bfloat16
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert documents_module.varlen_dtype(q.float()) == (torch.bfloat16 if autocast else None)
        got = output_and_grads(lambda *t: document_attention(*t, documents),
                               *(t.float() if autocast else t for t in (q, k, v)), upstream)
    want = output_and_grads(lambda *t: dense_oracle(*t, ids), *(t.float() for t in (q, k, v, upstream)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a.float(), b, atol=3e-2, rtol=2e-2, msg=f"{name} {layout}")
