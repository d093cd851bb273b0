"""Whole conversations packed into training sequences (`mop.data.packing`: best-fit decreasing).

Each conversation of a chat corpus (`mop.data.chat.corpus`) is one document of `n` tokens: it fits a
sequence of `S = data.seq_len` tokens when `n <= S` (inputs are its n tokens; the label of token t
is token t + 1 when that token is an assistant target, or any token with `data.loss_on = "all"`,
and the last token's label is ignored, so no target crosses its end).

Overlong conversations (`n > S`, `data.overlong`): "drop" leaves them out; "truncate" keeps the
longest prefix that ends at a turn boundary (the end of a run of targets: an assistant turn's
end-of-turn token) within S tokens, and drops the conversation when no assistant turn ends
within S (`mop.data.packing.fitted_lengths`). Both are counted (`Packing.dropped`,
`Packing.truncated`). No conversation is ever split.

`ChatDataset[i]` builds sequence i from its conversations (a few array slices of the corpus,
memory-mapped or not): `input_ids`, `labels`, `position_ids` (restarting per conversation),
`document_ids` (0, 1, ... per conversation, the padding last) and `padding` (bool).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from mop.data.errors import DataError
from mop.data.packing import PackedRow, Packing, fitted_lengths, pack
from mop.data.prepared import Corpus


def trained_tokens(targets: np.ndarray, loss_on: str) -> np.ndarray:
    """Which tokens of a conversation the loss predicts (the label of the position before each): its
    targets, or every token with `loss_on = "all"`; never its first, which no position of it predicts."""
    trained = np.ones(len(targets), dtype=bool) if loss_on == "all" else np.array(targets, dtype=bool)
    trained[:1] = False
    return trained


class ChatDataset(Dataset):
    """Packed sequence i of a chat corpus as a dict of tensors (the module docstring)."""

    def __init__(self, corpus: Corpus, seq_len: int, overlong: str, seed: int, pad_id: int,
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
