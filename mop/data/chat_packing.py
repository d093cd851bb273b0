"""Whole conversations packed into training sequences by best-fit decreasing.

Each conversation of a `ChatCorpus` is one document of `n` tokens: it fits a sequence of `S =
data.seq_len` tokens when `n <= S` (inputs are its n tokens; the label of token t is token t + 1
when that token is an assistant target, or any token with `data.loss_on = "all"`, and the last
token's label is ignored, so no target crosses its end).

Overlong conversations (`n > S`, `data.overlong`): "drop" leaves them out; "truncate" keeps the
longest prefix that ends at a turn boundary (the end of a run of targets: an assistant turn's
end-of-turn token) within S tokens, and drops the conversation when no assistant turn ends
within S. Both are counted (`Packing.dropped`, `Packing.truncated`).

Packing (`best_fit_decreasing`): conversations in order of decreasing length (ties in an order
drawn from the seed), each into the open sequence with the least room that still holds it, else a
new one; the sequences are then put in an order drawn from the seed. Sequences with room left
are padded at the end: padding is its own document, its labels
are ignored and its `padding` flag set (the router statistics and tokens/s leave it out).
The open sequences are kept in buckets by remaining room, and the room values present in one sorted
list (the smallest room >= n is a bisection); the list holds at most min(sequences, S) values, at
most the square root of the corpus's tokens, so packing costs O(conversations x log) plus short
list moves, and no conversation is ever split.

`ChatDataset[i]` builds sequence i from its conversations (a few array slices of the corpus,
memory-mapped or not): `input_ids`, `labels`, `position_ids` (restarting per conversation),
`document_ids` (0, 1, ... per conversation, the padding last) and `padding` (bool).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from mop.data.errors import DataError
from mop.data.packing import IGNORE_INDEX
from mop.data.prepared import ChatCorpus


@dataclass
class Packing:
    """Sequence i holds the conversations `items[bounds[i]:bounds[i+1]]`, their first `lengths` tokens."""

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


def fitted_lengths(corpus: ChatCorpus, seq_len: int, overlong: str) -> tuple[np.ndarray, int, int]:
    """Each conversation's length as trained (0: dropped), and the dropped and truncated counts."""
    lengths = np.diff(corpus.offsets)
    over = np.flatnonzero(lengths > seq_len)
    kept = lengths.copy()
    kept[over] = 0
    if overlong == "truncate":
        for k in over:  # overlong conversations are few: each looks at its first seq_len + 1 targets
            start = int(corpus.offsets[k])
            kept[k] = truncated_length(np.asarray(corpus.targets[start:start + seq_len + 1], dtype=bool))
    truncated = int(np.count_nonzero(kept[over]))
    return kept, len(over) - truncated, truncated


def trained_tokens(targets: np.ndarray, loss_on: str) -> np.ndarray:
    """Which tokens of a conversation the loss predicts (the label of the position before each): its
    targets, or every token with `loss_on = "all"`; never its first, which no position of it predicts."""
    trained = np.ones(len(targets), dtype=bool) if loss_on == "all" else np.array(targets, dtype=bool)
    trained[:1] = False
    return trained


def truncated_length(targets: np.ndarray) -> int:
    """The longest prefix of an overlong conversation, given its first `seq_len + 1` targets, that
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


class ChatDataset(Dataset):
    """Packed sequence i of a chat corpus as a dict of tensors (the module docstring)."""

    def __init__(self, corpus: ChatCorpus, seq_len: int, overlong: str, seed: int, pad_id: int,
                 loss_on: str = "assistant"):
        if seq_len < 2:
            raise DataError(f"data.seq_len = {seq_len}: a conversation needs at least 2 tokens; raise data.seq_len")
        self.corpus, self.seq_len, self.pad_id, self.loss_on = corpus, seq_len, pad_id, loss_on
        lengths, dropped, truncated = fitted_lengths(corpus, seq_len, overlong)
        items, bounds = pack(lengths, seq_len, seed)
        self.packing = Packing(items, lengths[items], bounds, dropped, truncated)
        self.fingerprint = f"{corpus.fingerprint}/{seq_len}/{overlong}/{seed}/{loss_on}"
        self.stats = self.packing.stats("conversations", seq_len, corpus.skipped)
        if len(self) == 0:
            raise DataError(f"data.source: no conversation fits data.seq_len = {seq_len} ({self.packing.dropped} "
                            "dropped as overlong); raise data.seq_len or set data.overlong = 'truncate'")

    def __len__(self) -> int:
        return len(self.packing.bounds) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        p, row = self.packing, PackedRow(self.seq_len, self.pad_id)
        for k in range(p.bounds[i], p.bounds[i + 1]):
            start, n = int(self.corpus.offsets[p.items[k]]), int(p.lengths[k])
            row.document(self.corpus.tokens[start:start + n],
                         trained_tokens(self.corpus.targets[start:start + n], self.loss_on))
        return row.tensors()
