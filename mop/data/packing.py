"""Packing documents into fixed-length training sequences that keep document boundaries: a text
stream cut into windows (`PackedDataset`), or whole items (conversations, preference pairs, rollouts:
each format package's dataset) packed by best-fit decreasing (`pack`, `PackedRow`).

Text. The token stream is every document followed by the eos token, concatenated; ``doc_starts`` is
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

Whole items. An item of `n` tokens (a corpus's `tokens[offsets[k]:offsets[k + 1]]`, or a unit a
format builds of it) is never split. One longer than `S` is overlong (`fitted_lengths`,
`data.overlong`): "drop" leaves it out; "truncate" keeps its longest prefix that ends at a turn
boundary (the end of a run of targets) within S tokens, and drops it when none ends within S. Both
are counted (`Packing.dropped`, `Packing.truncated`).

Packing (`best_fit_decreasing`): items in order of decreasing length (ties in an order drawn from
the seed), each into the open sequence with the least room that still holds it, else a new one;
the sequences are then put in an order drawn from the seed (`pack`). Sequences with room left
are padded at the end: padding is its own document, its labels are ignored and its `padding`
flag set (the router statistics and tokens/s leave it out; `PackedRow`). The open sequences are
kept in buckets by remaining room, and the room values present in one sorted list (the smallest
room >= n is a bisection); the list holds at most min(sequences, S) values, at most the square
root of the corpus's tokens, so packing costs O(items x log) plus short list moves.
"""

import hashlib
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


@dataclass
class Packing:
    """Sequence i holds the items `items[bounds[i]:bounds[i+1]]`, their first `lengths` tokens."""

    items: np.ndarray
    lengths: np.ndarray
    bounds: np.ndarray
    dropped: int
    truncated: int

    def stats(self, unit: str, seq_len: int, skipped: int, **counts: int) -> dict:
        """What a run reports of the packed data, in this order: `data_<unit>` (the items packed), the
        overlong ones dropped and truncated, the invalid rows skipped, `counts` and the share of the
        sequences' `seq_len` tokens that is padding."""
        real = int(self.lengths.sum())
        return {f"data_{unit}": len(self.items), "data_overlong_dropped": self.dropped,
                "data_overlong_truncated": self.truncated, "data_skipped_invalid": skipped, **counts,
                "data_padding_share": 1 - real / max(1, (len(self.bounds) - 1) * seq_len)}


def describe_packed(stats: dict, unit: str, sequences: int) -> str:
    """The start line's account of packed data from its `Packing.stats`."""
    return (f"{stats[f'data_{unit}']} {unit} in {sequences} sequences, {stats['data_padding_share']:.1%} padding; "
            f"overlong: {stats['data_overlong_dropped']} dropped, {stats['data_overlong_truncated']} truncated; "
            f"{stats['data_skipped_invalid']} invalid skipped")


def fitted_lengths(corpus, seq_len: int, overlong: str) -> tuple[np.ndarray, int, int]:
    """Each item's length as trained (0: dropped; the module docstring) of a corpus's `offsets` and
    `targets`, and the dropped and truncated counts."""
    lengths = np.diff(corpus.offsets)
    over = np.flatnonzero(lengths > seq_len)
    kept = lengths.copy()
    kept[over] = 0
    if overlong == "truncate":
        for k in over:  # overlong items are few: each looks at its first seq_len + 1 targets
            start = int(corpus.offsets[k])
            kept[k] = truncated_length(np.asarray(corpus.targets[start:start + seq_len + 1], dtype=bool))
    truncated = int(np.count_nonzero(kept[over]))
    return kept, len(over) - truncated, truncated


def truncated_length(targets: np.ndarray) -> int:
    """The longest prefix of an overlong item, given its first `seq_len + 1` targets, that
    ends at a turn boundary (the end of a run of targets) within `seq_len` tokens; 0 where none does."""
    ends = np.flatnonzero(targets[:-1] & ~targets[1:]) + 1  # a run of targets ends before position `end`
    return int(ends[-1]) if len(ends) else 0


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Items (indices into `lengths`, zeros left out) grouped into bins of `capacity`: `(items,
    bounds)`, bin b holding `items[bounds[b]:bounds[b+1]]` (the module docstring)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    order = order[lengths[order] > 0]
    rooms: dict[int, list[int]] = {}  # room left -> the open sequences with that room
    sizes: list[int] = []  # the room values present, sorted
    bin_of = np.empty(len(order), dtype=np.int64)
    bins = 0
    for position, item in enumerate(order.tolist()):
        size = int(lengths[item])
        at = bisect_left(sizes, size)
        if at < len(sizes):
            room = sizes[at]
            stack = rooms[room]
            chosen = stack.pop()
            if not stack:
                del rooms[room], sizes[at]
        else:
            chosen, room = bins, capacity
            bins += 1
        bin_of[position] = chosen
        left = room - size
        if left:
            if left not in rooms:
                rooms[left] = []
                insort(sizes, left)
            rooms[left].append(chosen)
    grouping = np.argsort(bin_of, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=bins))]).astype(np.int64)
    return order[grouping], bounds


def pack(lengths: np.ndarray, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Items of `lengths` (zeros left out) packed into sequences by `best_fit_decreasing`, `(items,
    bounds)` in an order drawn from the seed: best fit numbers the sequences as it opens them, longest
    items first, and a held-out split (the last sequences) or an evaluation (the first ones) must not
    see only the shortest or the longest."""
    items, bounds = best_fit_decreasing(lengths, seq_len, seed)
    sizes = np.diff(bounds)
    rank = np.random.default_rng([seed, 1]).permutation(len(sizes))  # sequence b becomes sequence rank[b]
    items = items[np.argsort(np.repeat(rank, sizes), kind="stable")]
    bounds = np.concatenate([[0], np.cumsum(sizes[np.argsort(rank)])]).astype(np.int64)
    return items, bounds


class PackedRow:
    """One packed sequence being written: its [S] arrays, the documents written one after another
    from its start (`number` of them, `at` tokens), and after them padding: pad tokens without labels,
    made one more document with positions from 0 by `tensors`."""

    def __init__(self, seq_len: int, pad_id: int):
        self.ids = np.full(seq_len, pad_id, dtype=np.int64)
        self.labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        self.positions = np.zeros(seq_len, dtype=np.int64)
        self.documents = np.zeros(seq_len, dtype=np.int32)
        self.at = self.number = 0

    def document(self, tokens: np.ndarray, trained: np.ndarray, position: int = 0) -> int:
        """Append a document, its positions from `position`: token t is the label of the token before
        it where `trained[t]` (never the first token, which nothing of the document precedes); returns
        where the document starts."""
        start, n = self.at, len(tokens)
        self.ids[start:start + n] = tokens
        self.labels[start:start + n - 1] = np.where(trained[1:], self.ids[start + 1:start + n], IGNORE_INDEX)
        self.positions[start:start + n] = np.arange(position, position + n)
        self.documents[start:start + n] = self.number
        self.at, self.number = start + n, self.number + 1
        return start

    def tensors(self, **more: np.ndarray) -> dict[str, torch.Tensor]:
        """The row with its padding as tensors: `input_ids`, `labels`, `position_ids`, `document_ids`,
        `more` and `padding` (bool)."""
        padding = np.zeros(len(self.ids), dtype=bool)
        padding[self.at:] = True
        self.documents[self.at:] = self.number
        self.positions[self.at:] = np.arange(len(self.ids) - self.at)
        arrays = {"input_ids": self.ids, "labels": self.labels, "position_ids": self.positions,
                  "document_ids": self.documents, **more, "padding": padding}
        return {key: torch.from_numpy(value) for key, value in arrays.items()}
