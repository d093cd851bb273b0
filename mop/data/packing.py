"""Packing documents into fixed-length training sequences that keep document boundaries.

The token stream is every document followed by the eos token, concatenated; ``doc_starts`` is
the sorted int64 array of offsets at which documents begin (``doc_starts[0] == 0``). The eos
token belongs to the document it ends.

With ``S = seq_len``, sequence ``i`` is the window ``stream[i*S : i*S + S + 1]``: inputs are its
first S tokens, labels its last S (the next token, already shifted). Consecutive windows share
one token, so every token after the first is a target exactly once; the tail that cannot fill a
window is dropped, and ``len = (n_tokens - 1) // S``.

Per sequence, besides ``input_ids`` and ``labels`` (int64 ``[S]``):

- ``document_ids`` (int32 ``[S]``): 0 for the document the sequence starts in, +1 at each
  document start inside it. Attention must never cross from one id to another.
- ``position_ids`` (int64 ``[S]``): offset within the document, restarting at 0 at each
  document start and at the sequence start (a document spilling over from the previous
  sequence continues at 0, since nothing before the sequence is visible to the model).
- ``labels`` are -100 (ignored) where the next token starts a new document: the target of a
  document's last token (its eos) would be the first token of an unrelated document. Every
  other position, including the eos itself as the target of the token before it, is trained.

A sequence is a pure slice of the stream and its boundaries come from a binary search in
``doc_starts``, so the stream may be an ``np.memmap`` of a pre-tokenised file (or several,
through ``ConcatTokens``): an item reads only its S + 1 tokens.
"""

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from mop.data.errors import DataError

IGNORE_INDEX = -100


def pack_documents(docs: Iterable[Sequence[int]], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents, each followed by eos; returns ``(tokens uint32, doc_starts)``."""
    parts, lengths = [], []
    eos = np.array([eos_id], dtype=np.uint32)
    for doc in docs:
        parts += [np.asarray(doc, dtype=np.uint32), eos]
        lengths.append(len(doc) + 1)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    doc_starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)
    return tokens, doc_starts


class ConcatTokens:
    """Several 1-D token arrays (in memory or memmaps) read as one, without copying them."""

    def __init__(self, parts: Sequence[np.ndarray]):
        self.parts = list(parts)
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise ValueError("ConcatTokens supports contiguous slices only")
        out = []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for k in range(max(first, 0), len(self.parts)):
            lo = int(self.offsets[k])
            if lo >= stop:
                break
            out.append(np.asarray(self.parts[k][max(start - lo, 0) : stop - lo], dtype=np.int64))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _sampled_bytes(a, chunks: int = 64, chunk: int = 4096):
    # Hashing a multi-GB memmap in full would cost a minute at every start; evenly spaced chunks
    # (first and last included) catch a different file, tokenizer or order just as well.
    n = len(a)
    if n <= chunks * chunk:
        yield np.asarray(a[0:n], dtype=np.int64).tobytes()
        return
    for k in range(chunks):
        lo = (n - chunk) * k // (chunks - 1)
        yield np.asarray(a[lo : lo + chunk], dtype=np.int64).tobytes()


def fingerprint(tokens, doc_starts: np.ndarray) -> str:
    """A short hash identifying a token stream and its documents, recorded for safe resumes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([len(tokens), len(doc_starts)], dtype=np.int64).tobytes())
    for arr in (tokens, doc_starts):
        for b in _sampled_bytes(arr):
            h.update(b)
    return h.hexdigest()


class PackedDataset(Dataset):
    """Sequence ``i`` of the packed stream as a dict of tensors; see the module docstring."""

    stats: dict = {}
    """What a run reports of its data beyond the sequence count (a text stream: nothing)."""

    def __init__(self, tokens, doc_starts: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise DataError(f"data.seq_len = {seq_len} must be positive; set data.seq_len >= 1")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"data.seq_len = {seq_len} needs at least {seq_len + 1} tokens but the corpus has "
                f"{len(tokens)}; lower data.seq_len or use a larger data.source"
            )
        doc_starts = np.asarray(doc_starts, dtype=np.int64)
        if len(doc_starts) == 0 or doc_starts[0] != 0 or np.any(np.diff(doc_starts) <= 0):
            raise ValueError("doc_starts must be strictly increasing and start at 0")
        self.tokens = tokens
        self.doc_starts = doc_starts
        self.seq_len = seq_len
        self.fingerprint = fingerprint(tokens, doc_starts)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        S = self.seq_len
        a = i * S
        window = np.asarray(self.tokens[a : a + S + 1], dtype=np.int64)
        # Document starts strictly inside the window, as offsets 1..S from its first token.
        lo = np.searchsorted(self.doc_starts, a, side="right")
        hi = np.searchsorted(self.doc_starts, a + S, side="right")
        inner = self.doc_starts[lo:hi] - a

        labels = window[1:].copy()
        labels[inner - 1] = IGNORE_INDEX
        in_inputs = inner[inner < S]
        starts = np.zeros(S, dtype=np.int64)
        starts[in_inputs] = 1
        document_ids = np.cumsum(starts)
        segment_start = np.concatenate([[0], in_inputs])[document_ids]
        return {
            "input_ids": torch.from_numpy(window[:-1].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(np.arange(S, dtype=np.int64) - segment_start),
            "document_ids": torch.from_numpy(document_ids.astype(np.int32)),
        }
