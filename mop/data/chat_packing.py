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
        real = int(self.packing.lengths.sum())
        self.stats = {"data_conversations": len(self.packing.items), "data_overlong_dropped": self.packing.dropped,
                      "data_overlong_truncated": self.packing.truncated, "data_skipped_invalid": corpus.skipped,
                      "data_padding_share": 1 - real / max(1, len(self) * seq_len)}
        if len(self) == 0:
            raise DataError(f"data.source: no conversation fits data.seq_len = {seq_len} ({self.packing.dropped} "
                            "dropped as overlong); raise data.seq_len or set data.overlong = 'truncate'")

    def __len__(self) -> int:
        return len(self.packing.bounds) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        p, S = self.packing, self.seq_len
        ids = np.full(S, self.pad_id, dtype=np.int64)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(S, dtype=np.int64)
        documents = np.zeros(S, dtype=np.int32)
        at = 0
        for number, k in enumerate(range(p.bounds[i], p.bounds[i + 1])):
            start, n = int(self.corpus.offsets[p.items[k]]), int(p.lengths[k])
            ids[at:at + n] = self.corpus.tokens[start:start + n]
            trained = trained_tokens(self.corpus.targets[start:start + n], self.loss_on)
            labels[at:at + n - 1] = np.where(trained[1:], ids[at + 1:at + n], IGNORE_INDEX)
            positions[at:at + n] = np.arange(n)
            documents[at:at + n] = number
            at += n
        documents[at:] = documents[at - 1] + 1
        positions[at:] = np.arange(S - at)
        padding = np.zeros(S, dtype=bool)
        padding[at:] = True
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents),
                "padding": torch.from_numpy(padding)}
