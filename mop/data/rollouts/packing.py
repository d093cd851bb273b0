"""Recorded rollouts packed into training sequences, each whole (issue 47).

Each rollout of a `RolloutCorpus` (`mop.data.rollouts.corpus`) is one document, its prompt then its
completion, packed as conversations are (`mop.data.packing.pack`: best-fit decreasing, sequences in an
order drawn from the seed). A rollout longer than `data.seq_len` is dropped and counted: cutting it
would train on a trajectory the engine never sampled (the settings refuse data.overlong =
"truncate").

`RolloutDataset[i]` holds, as [S] tensors, what `ChatDataset` does (`input_ids`, `labels`: the token
before each generated completion token predicts it, `position_ids`, `document_ids`, `padding`) and,
on each position whose label is a generated token (0, NaN or -1 elsewhere):
- `advantages` (float32) and `sampling_logps` (float32, NaN: unknown) of that token;
- `rollout_ids` (int64): the rollout's number in its sequence (0, 1, ... in packing order), the slot
  its per-rollout sums go to; `rollout_tokens` (float32): the rollout's generated tokens n_i;
- `rollout_starts` (bool): its first such position, so any slice of the row counts each rollout once
  (`loader.sequence_shard`); `rewards` (float32, NaN but at a start: the rollout's reward, NaN when
  it has none) and `zero_std` (bool, at a start: `RolloutCorpus.zero_std`);
- `sequence_starts` (bool): True at position 0 of a sequence holding rollouts, so the step counts the
  sequences that are data (the RL loop pads its batches with empty ones, `RolloutSettings.sequences`);
- with routes, `routes` (int16 `[S, moe_layers, top_k]`): each input token's recorded experts (-1:
  none; no shift: token t's routes are its own), what the MoE layers replay;
- once the trainer sets `reference` (float32 `[sequences, S]`, each position's reference log-prob of
  its label, `mop.objectives.policy_gradient.reference`), `reference_logps` (float32): its row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from mop.data.errors import DataError
from mop.data.packing import PackedRow, Packing, fitted_lengths, pack
from mop.data.rollouts.corpus import RolloutCorpus


def padded_bounds(bounds: np.ndarray, sequences: int, seq_len: int) -> np.ndarray:
    """A packing's sequence bounds with empty sequences (padding only, no target) after its own, `sequences`
    in all: the RL loop's batches hold a fixed count whatever its rollouts' lengths."""
    packed = len(bounds) - 1
    if packed > sequences:
        raise DataError(f"train.global_batch: the batch's rollouts fill {packed} sequences of data.seq_len = "
                        f"{seq_len} tokens and the batch holds {sequences}; raise train.global_batch or data.seq_len, "
                        "or lower rl.prompts_per_batch, rl.group or rl.max_completion_length")
    return np.concatenate([bounds, np.full(sequences - packed, bounds[-1], dtype=bounds.dtype)])


class RolloutDataset(Dataset):
    """Packed sequence i of recorded rollouts as a dict of tensors (the module docstring)."""

    def __init__(self, corpus: RolloutCorpus, seq_len: int, seed: int, pad_id: int, sequences: int = 0):
        if seq_len < 2:
            raise DataError(f"data.seq_len = {seq_len}: a rollout needs at least 2 tokens; raise data.seq_len")
        self.corpus, self.seq_len, self.pad_id = corpus, seq_len, pad_id
        kept, dropped, _ = fitted_lengths(corpus, seq_len, "drop")
        items, bounds = pack(kept, seq_len, seed)
        if sequences:
            bounds = padded_bounds(bounds, sequences, seq_len)
        self.packing = Packing(items, kept[items], bounds, dropped, 0)
        self.rollouts_max = int(np.diff(bounds).max(initial=1))
        self.reference: np.ndarray | None = None  # set by the trainer: then items have reference_logps
        self.fingerprint = f"{corpus.fingerprint}/{seq_len}/{seed}"
        self.stats = self.packing.stats("rollouts", seq_len, corpus.skipped)
        if len(self) == 0:
            raise DataError(f"data.source: no rollout fits data.seq_len = {seq_len} ({self.packing.dropped} dropped as "
                            "overlong); raise data.seq_len")

    def __len__(self) -> int:
        return len(self.packing.bounds) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        c, p, s = self.corpus, self.packing, self.seq_len
        row = PackedRow(s, self.pad_id)
        extra = {"advantages": np.zeros(s, np.float32), "sampling_logps": np.full(s, np.nan, np.float32),
                 "rollout_ids": np.full(s, -1, np.int64), "rollout_tokens": np.zeros(s, np.float32),
                 "rollout_starts": np.zeros(s, bool), "rewards": np.full(s, np.nan, np.float32),
                 "zero_std": np.zeros(s, bool), "sequence_starts": np.zeros(s, bool)}
        extra["sequence_starts"][0] = p.bounds[i + 1] > p.bounds[i]  # not one of the RL loop's empty sequences
        if c.routes is not None:
            extra["routes"] = np.full((s, *c.routes.shape[1:]), -1, np.int16)
        for j, k in enumerate(range(p.bounds[i], p.bounds[i + 1])):
            item = int(p.items[k])
            part = slice(int(c.offsets[item]), int(c.offsets[item + 1]))
            trained = np.asarray(c.targets[part], dtype=bool)  # the first token's is never read: nothing precedes it
            start = row.document(c.tokens[part], trained)
            n = part.stop - part.start
            here = slice(start, start + n - 1)  # position t predicts token t + 1
            labelled = trained[1:]
            extra["advantages"][here] = np.where(labelled, c.advantages[part][1:], 0)
            extra["sampling_logps"][here] = np.where(labelled, c.sampling[part][1:], np.nan)
            extra["rollout_ids"][here] = np.where(labelled, j, -1)
            extra["rollout_tokens"][here] = np.where(labelled, labelled.sum(), 0)
            first = start + int(np.argmax(labelled))
            extra["rollout_starts"][first] = True
            extra["rewards"][first] = c.rewards[item]
            extra["zero_std"][first] = c.zero_std[item]
            if c.routes is not None:
                extra["routes"][start:start + n] = c.routes[part]
        if self.reference is not None:
            extra["reference_logps"] = np.array(self.reference[i], dtype=np.float32)
        return row.tensors(**extra)
