"""Packing with document boundaries, and the deterministic sequence order."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mop.data import (
    IGNORE_INDEX,
    ConcatTokens,
    DataError,
    PackedDataset,
    SequenceStream,
    fingerprint,
    group_slice,
    micro_batches,
    pack_documents,
)
from mop.data.loader import epoch_seed

EOS = 257


def reference(docs, seq_len):
    """Per-sequence expectations computed token by token from the document list."""
    stream, doc_of, start_of = [], [], []
    for d, doc in enumerate(docs):
        start = len(stream)
        for tok in [*doc, EOS]:
            stream.append(tok)
            doc_of.append(d)
            start_of.append(start)
    out = []
    for i in range((len(stream) - 1) // seq_len):
        a = i * seq_len
        ts = range(a, a + seq_len)
        out.append({
            "input_ids": [stream[t] for t in ts],
            "labels": [IGNORE_INDEX if doc_of[t + 1] != doc_of[t] else stream[t + 1] for t in ts],
            "position_ids": [t - max(start_of[t], a) for t in ts],
            "document_ids": [doc_of[t] - doc_of[a] for t in ts],
        })
    return out


docs_strategy = st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=20), min_size=1,
                         max_size=12)


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 17), cuts=st.lists(st.integers(0, 300)))
def test_packing_matches_reference(docs, seq_len, cuts):
    tokens, starts = pack_documents(docs, EOS)
    if len(tokens) < seq_len + 1:
        with pytest.raises(DataError, match="data.seq_len"):
            PackedDataset(tokens, starts, seq_len)
        return
    # The same stream split into arbitrary parts (as a directory of files would be) reads alike.
    bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
    split = ConcatTokens([tokens[a:b] for a, b in zip(bounds, bounds[1:])])
    expected = reference(docs, seq_len)
    for stream in (tokens, split):
        ds = PackedDataset(stream, starts, seq_len)
        assert len(ds) == len(expected)
        for i, exp in enumerate(expected):
            item = ds[i]
            for key, value in exp.items():
                assert item[key].tolist() == value, (i, key)


def test_packing_example():
    # docs "ab" and "cde": stream a b E c d e E
    ds = PackedDataset(*pack_documents([[1, 2], [3, 4, 5]], EOS), seq_len=3)
    assert len(ds) == 2
    first, second = ds[0], ds[1]
    assert first["input_ids"].tolist() == [1, 2, EOS]
    assert first["labels"].tolist() == [2, EOS, IGNORE_INDEX]  # eos -> next document: ignored
    assert first["position_ids"].tolist() == [0, 1, 2]
    assert second["input_ids"].tolist() == [3, 4, 5]
    assert second["labels"].tolist() == [4, 5, EOS]
    assert second["position_ids"].tolist() == [0, 1, 2]
    assert second["document_ids"].dtype == torch.int32
    with pytest.raises(IndexError):
        ds[2]


def test_spilled_document_restarts_at_zero():
    # stream 1 2 3 4 5 6 E 7 E; sequence 1 starts inside the first document, at its token 5.
    ds = PackedDataset(*pack_documents([[1, 2, 3, 4, 5, 6], [7]], EOS), seq_len=4)
    item = ds[1]
    assert item["input_ids"].tolist() == [5, 6, EOS, 7]
    assert item["position_ids"].tolist() == [0, 1, 2, 0]
    assert item["document_ids"].tolist() == [0, 0, 0, 1]
    assert item["labels"].tolist() == [6, EOS, IGNORE_INDEX, EOS]


def test_fingerprint_tracks_content():
    tokens, starts = pack_documents([[1, 2], [3]], EOS)
    assert fingerprint(tokens, starts) == fingerprint(tokens.astype(np.uint16), starts)
    assert fingerprint(tokens, starts) != fingerprint(tokens[::-1].copy(), starts)
    big = np.arange(1 << 20, dtype=np.uint32)
    assert fingerprint(big, np.array([0])) != fingerprint(big[::-1].copy(), np.array([0]))


def make_stream(seed=0, n=10, fp="abc"):
    return SequenceStream(num_sequences=n, seed=seed, seq_len=8, fingerprint=fp)


def test_order_is_a_function_of_the_seed():
    a, b, c = make_stream(0), make_stream(0), make_stream(1)
    assert a.indices(0, 35) == b.indices(0, 35)
    assert a.indices(0, 10) != c.indices(0, 10)
    epochs = [sorted(a.indices(10 * e, 10)) for e in range(3)]
    assert epochs == [list(range(10))] * 3
    assert a.indices(0, 10) != a.indices(10, 10)  # each epoch reshuffles
    # Random access and sequential reading agree across epoch boundaries.
    assert a.indices(7, 6) == a.indices(0, 20)[7:13]
    g = torch.Generator().manual_seed(epoch_seed(0, 1))
    assert a.indices(10, 10) == torch.randperm(10, generator=g).tolist()
    # Seed 0's second epoch is not seed 1's first.
    assert a.indices(10, 10) != c.indices(0, 10)


@pytest.mark.parametrize("groups,micro", [(1, 1), (2, 3), (3, 2), (6, 1)])
def test_group_slices_concatenate_to_the_step(groups, micro):
    s = make_stream(n=7)
    for step in range(4):
        full = s.batch(step, 12)
        parts = [group_slice(full, g, groups) for g in range(groups)]
        assert sum(parts, []) == full
        for part in parts:
            assert sum(micro_batches(part, micro), []) == part
            assert all(len(mb) == micro for mb in micro_batches(part, micro))
    with pytest.raises(DataError, match="not divisible"):
        group_slice(s.batch(0, 12), 0, 5)
    with pytest.raises(DataError, match="micro-batch"):
        micro_batches(list(range(6)), 4)


def test_resume_continues_identically():
    a = make_stream(seed=3, n=9)
    seen = [a.next_batch(4) for _ in range(5)]
    assert seen == [a.batch(s, 4) for s in range(5)]
    state = a.state_dict()
    b = make_stream(seed=3, n=9)
    b.load_state_dict(state)
    assert [b.next_batch(4) for _ in range(4)] == [a.next_batch(4) for _ in range(4)]
    for other in (make_stream(seed=4, n=9), make_stream(seed=3, n=10),
                  make_stream(seed=3, n=9, fp="other")):
        with pytest.raises(DataError, match="cannot resume"):
            other.load_state_dict(state)
