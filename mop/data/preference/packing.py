"""Preference pairs packed into training sequences with each prompt computed once (issue 39).

A pair of a `PreferenceCorpus` (`mop.data.preference.corpus`) has a prompt P (p >= 1 tokens), a chosen
response C (c >= 1) and a rejected one R (r >= 1). It is one unit, never split between sequences:
- shared (`data.shared_prompt`, the default): `[P | C]` is one document, positions 0 .. p+c-1; then
  `[P[-1] | R]` is the next one, a branch: its tokens carry `prefix_lengths = p - 1`, so it also
  attends to the first p - 1 tokens of the document before it (`mop.models.documents`), and its
  positions continue the prompt's, p-1 .. p+r-1. The prompt's last token is repeated because it
  predicts each response's first token, and a token carries one label. Unit length p + c + 1 + r.
- unshared (the computation the exactness tests and `mop bench dpo` compare against): `[P | C]` then
  `[P | R]`, two plain documents, positions from 0 in each. Unit length 2p + c + r.

Labels (already shifted; IGNORE_INDEX elsewhere): in each document the token before each response
token predicts it where that token is trained: an assistant target (`data.loss_on = "assistant"`),
or any response token with "all" (TRL's rule: every token after the prompt). The prompt's tokens but
its last, and each document's last token, carry no label. `response_ids` is 2j on the tokens that
predict pair j's chosen tokens (trained or not), 2j + 1 on those predicting its rejected ones, -1
elsewhere; j numbers a sequence's pairs in packing order (`pairs_of`).

Overlong units (longer than S = data.seq_len; data.overlong): "drop" leaves them out; "truncate"
cuts the prompt from the left, keeping its last p' tokens, the most that fit, the same for both
responses (shared p' = S - (c + 1 + r), unshared floor((S - c - r) / 2)); a unit is dropped where
p' < 1. Both are counted (`stats`), and so are the corpus's degenerate pairs (chosen and rejected the
same tokens, `mop.data.preference.rows.same_responses`), which the trainer warns about.

Units are packed as conversations are (`mop.data.packing.pack`: best-fit decreasing, sequences in an
order drawn from the seed); one prepared folder serves every seq_len, overlong, loss_on and
shared_prompt. `PreferenceDataset[i]` holds, as [S] tensors: `input_ids`, `labels`, `position_ids`,
`prefix_lengths`, `response_ids` (int64), `document_ids` (int32: 0, 1, ... per document, the padding
its own last one), `padding` (bool), as `ChatDataset` does; `pair_starts` (bool: each pair's first
response token, so any slice of rows counts its pairs once); and, once the trainer sets `reference`
(float64 [corpus_pairs, 2], each pair's reference log-prob sums of its chosen and rejected
responses), `reference_logps` (float64): pair j's chosen sum on the first token whose response id is
2j, its rejected sum on the first with 2j + 1, 0 elsewhere, so that a response's reference is the sum
over its tokens, which holds on any slice of the row (`loader.sequence_shard`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from mop.data.errors import DataError
from mop.data.packing import PackedRow, Packing, pack
from mop.data.preference.corpus import PreferenceCorpus


def unit_lengths(parts: np.ndarray, prompts: np.ndarray, shared: bool) -> np.ndarray:
    """Each pair's packed length with a prompt of `prompts` tokens (`parts`: [n, 3] p, c, r)."""
    responses = parts[:, 1] + parts[:, 2]
    return responses + (prompts + 1 if shared else 2 * prompts)


def fitted_prompts(parts: np.ndarray, seq_len: int, overlong: str, shared: bool) -> tuple[np.ndarray, int, int]:
    """Each pair's prompt length as trained (0: dropped; the module docstring), and the dropped and
    truncated counts."""
    parts = np.asarray(parts, dtype=np.int64).reshape(-1, 3)
    prompts = parts[:, 0].copy()
    over = unit_lengths(parts, prompts, shared) > seq_len
    if overlong == "truncate":
        room = seq_len - parts[:, 1] - parts[:, 2]
        prompts[over] = (room - 1 if shared else room // 2)[over]
    else:
        prompts[over] = 0
    prompts = np.maximum(prompts, 0)
    truncated = int(np.count_nonzero(prompts[over]))
    return prompts, int(over.sum()) - truncated, truncated


def trained_response(targets: np.ndarray, loss_on: str) -> np.ndarray:
    """Which tokens of a response the loss trains: its targets, or all of them with `loss_on = "all"`."""
    return np.ones(len(targets), dtype=bool) if loss_on == "all" else np.asarray(targets, dtype=bool)


class _PairRow:
    """A packed row of preference pairs being written: a `PackedRow` whose documents are prompt tokens
    then a response, with each token's `prefix_lengths` and the `response_ids` of the tokens that
    predict a response."""

    def __init__(self, seq_len: int, pad_id: int):
        self.row = PackedRow(seq_len, pad_id)
        self.prefix_lengths = np.zeros(seq_len, dtype=np.int64)
        self.response_ids = np.full(seq_len, -1, dtype=np.int64)

    def document(self, lead: np.ndarray, response: np.ndarray, trained: np.ndarray, position: int,
                 prefix_length: int, response_id: int) -> int:
        """Append the document `lead | response` (lead: prompt tokens, at least one), its positions from
        `position`, labels only on the response; returns the index of the token that predicts the
        response's first token."""
        start = self.row.document(np.concatenate([lead, response]),
                                  np.concatenate([np.zeros(len(lead), dtype=bool), trained]), position)
        first = start + len(lead) - 1
        self.response_ids[first:first + len(response)] = response_id
        self.prefix_lengths[start:self.row.at] = prefix_length
        return first

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.row.tensors(prefix_lengths=self.prefix_lengths, response_ids=self.response_ids)


class PreferenceDataset(Dataset):
    """Packed sequence i of a preference corpus as a dict of [S] tensors (the module docstring)."""

    def __init__(self, corpus: PreferenceCorpus, seq_len: int, overlong: str, seed: int, pad_id: int,
                 loss_on: str = "assistant", shared: bool = True):
        self.corpus, self.seq_len, self.pad_id, self.loss_on, self.shared = corpus, seq_len, pad_id, loss_on, shared
        parts = np.asarray(corpus.parts, dtype=np.int64).reshape(-1, 3)
        prompts, dropped, truncated = fitted_prompts(parts, seq_len, overlong, shared)
        lengths = np.where(prompts > 0, unit_lengths(parts, prompts, shared), 0)
        items, bounds = pack(lengths, seq_len, seed)
        self.packing = Packing(items, lengths[items], bounds, dropped, truncated)
        self.prompts = prompts[items]  # the prompt tokens each packed pair keeps (its last ones)
        self.corpus_pairs = len(parts)  # the rows of `reference`
        self.reference: np.ndarray | None = None  # set by the trainer: then items have reference_logps
        self.pairs_max = int(np.diff(bounds).max(initial=0))
        self.fingerprint = f"{corpus.fingerprint}/{seq_len}/{overlong}/{seed}/{loss_on}/shared={shared}"
        self.stats = self.packing.stats("pairs", seq_len, corpus.skipped, data_degenerate_pairs=corpus.degenerate_pairs)
        if len(self) == 0:
            raise DataError(f"data.source: no preference pair fits data.seq_len = {seq_len} ({dropped} dropped as "
                            "overlong); raise data.seq_len or set data.overlong = 'truncate'")

    def __len__(self) -> int:
        return len(self.packing.bounds) - 1

    def pairs_of(self, i: int) -> np.ndarray:
        """The corpus indices of sequence i's pairs, in their order j."""
        return self.packing.items[self.packing.bounds[i]:self.packing.bounds[i + 1]]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        row = _PairRow(self.seq_len, self.pad_id)
        starts = []  # per pair, the tokens predicting its chosen and rejected responses' first tokens
        for j, k in enumerate(range(self.packing.bounds[i], self.packing.bounds[i + 1])):
            starts.append(self._unit(row, j, int(self.packing.items[k]), int(self.prompts[k])))
        out = row.tensors()
        pair_starts = np.zeros(self.seq_len, dtype=bool)
        pair_starts[[first for first, _ in starts]] = True
        out["pair_starts"] = torch.from_numpy(pair_starts)
        if self.reference is not None:
            reference = np.zeros(self.seq_len, dtype=np.float64)
            reference[np.asarray(starts, dtype=np.int64).reshape(-1)] = self.reference[self.pairs_of(i)].reshape(-1)
            out["reference_logps"] = torch.from_numpy(reference)
        return out

    def _unit(self, row: _PairRow, j: int, item: int, kept: int) -> tuple[int, int]:
        """Write pair `item` as the row's pair j, its prompt cut to its last `kept` tokens."""
        tokens, targets, (p, c, r) = self.corpus.item(item)
        tokens, trained = tokens.astype(np.int64), trained_response(targets, self.loss_on)
        prompt, chosen, rejected = tokens[p - kept:p], slice(p, p + c), slice(p + c, p + c + r)
        first = row.document(prompt, tokens[chosen], trained[chosen], 0, 0, 2 * j)
        if self.shared:  # the branch: the prompt's last token again, over the prompt's first kept - 1
            second = row.document(prompt[-1:], tokens[rejected], trained[rejected], kept - 1, kept - 1, 2 * j + 1)
        else:
            second = row.document(prompt, tokens[rejected], trained[rejected], 0, 0, 2 * j + 1)
        return first, second
