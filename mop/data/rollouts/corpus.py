"""Recorded rollouts gathered (`read_rollouts`): every row of a source encoded (`mop.data.rollouts.rows`)
and, for rows with rewards, GRPO's advantages computed (`group_advantages`), into a `RolloutCorpus`.

Advantages from rewards (TRL 1.16's `_generate_and_score_completions`): per group, the mean of its
known rewards; `scale_rewards` "group" divides by the group's unbiased standard deviation + 1e-4,
"batch" by that of every known reward of the source + 1e-4 (TRL takes the generation batch's: the
source is mop's batch), "none" by nothing; an unscorable rollout, or one whose group has one known
reward, gets 0. A rollout "has zero std" (`frac_reward_zero_std`) when the std it is scaled by is 0
(for "none", its group's; a group of one rollout has std 0, as TRL's for one generation). Such lone
groups train nothing but the KL (TRL refuses fewer than 2 generations): the corpus names them
(`lone_groups`) and a run warns once at its start.

Encoded (`RolloutCorpus`, held in memory: an RL step's rollouts are a file of one batch, not a
pre-training corpus; `mop data prepare` does not take them): rollout k is `tokens[offsets[k]:
offsets[k+1]]`, its prompt's `prompts[k]` tokens first; per token `targets` (the generated
completion tokens), `sampling` (float32, NaN but on targets), `advantages` (float32, 0 but on
targets), `routes` (int16 `[T, moe_layers, top_k]`, -1: none; None when no row has any).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mop.data.conversations import chat_files, iter_rows
from mop.data.errors import DataError
from mop.data.prepared import encode_rows, is_prepared, source_fingerprint
from mop.data.rollouts.rows import RolloutRows, RouteShape

ScaleRewards = Literal["group", "batch", "none"]
STD_EPSILON = 1e-4  # TRL's, added to the std an advantage is divided by


@dataclass(frozen=True)
class RolloutSettings:
    """What a run's recorded rollouts are read with beyond the chat settings."""

    shape: RouteShape
    scale_rewards: ScaleRewards = "group"
    sequences: int = 0
    """The packed sequences served (the RL loop's fixed global batch: empty ones pad the packing to it);
    0: as many as the rollouts fill."""


def group_advantages(rewards: np.ndarray, groups: list[str], scale: ScaleRewards) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's advantage and whether the std it is scaled by is 0 (module docstring)."""
    names, group_of = np.unique(np.asarray(groups), return_inverse=True)
    known = ~np.isnan(rewards)
    count = np.bincount(group_of, weights=known, minlength=len(names))
    total = np.bincount(group_of, weights=np.where(known, rewards, 0.0), minlength=len(names))
    mean = total / np.maximum(count, 1)
    squares = np.bincount(group_of, weights=np.where(known, (rewards - mean[group_of]) ** 2, 0.0), minlength=len(names))
    size = np.bincount(group_of, minlength=len(names))
    with np.errstate(invalid="ignore", divide="ignore"):  # a group of one rollout has std 0 (TRL's for 1 generation)
        group_std = np.where(count > 1, np.sqrt(squares / (count - 1)), np.where(size == 1, 0.0, np.nan))[group_of]
        batch_std = np.nanstd(rewards, ddof=1) if known.sum() > 1 else np.nan
    std = np.full(len(rewards), batch_std) if scale == "batch" else group_std
    advantages = rewards - mean[group_of]
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    advantages = np.where(np.isnan(advantages) | (count[group_of] < 2), 0.0, advantages)
    return advantages, np.isclose(np.nan_to_num(std, nan=1.0), 0.0)


@dataclass
class RolloutCorpus:
    """Encoded rollouts (module docstring)."""

    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    prompts: np.ndarray
    sampling: np.ndarray
    advantages: np.ndarray
    routes: np.ndarray | None
    rewards: np.ndarray
    """float64 `[n]`: each rollout's reward (NaN: none given, or unscorable)."""
    zero_std: np.ndarray
    """bool `[n]`: its advantage's std was 0 (`frac_reward_zero_std`; False without rewards)."""
    fingerprint: str
    skipped: int = 0
    lone_groups: tuple[str, ...] = ()
    """The groups of one rollout, in order (advantage 0: they train nothing but the KL)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1


def read_rollouts(source: str, encoder: RolloutRows, scale: ScaleRewards, skip_invalid: bool) -> RolloutCorpus:
    """Every row of `source` encoded, advantages from rewards computed (module docstring)."""
    if is_prepared(source):
        raise DataError(f"data.source: {source} is a prepared folder; rollouts are read from jsonl or parquet rows")
    encoded = encode_rows(encoder, [row for path in chat_files(source) for row in iter_rows(path)], skip_invalid)
    rollouts = [(where, item) for where, item in encoded if not isinstance(item, str)]
    if not rollouts:
        raise DataError(f"data.source = {source!r} holds no usable rollout; point it at rows of prompt and completion "
                        "token ids (or messages) with advantages or rewards")
    rewarded = rollouts[0][1].advantages is None  # the first usable row's signal is the source's
    other = [where for where, item in rollouts if (item.advantages is None) != rewarded]
    if other and not skip_invalid:
        raise DataError(f"data.source: {other[0]}: it gives {'an advantage' if rewarded else 'a reward'} where the "
                        f"source's first row gives {'a reward' if rewarded else 'an advantage'}; give every row an "
                        "advantage, or every row a reward and a group, or set data.skip_invalid = true to count and "
                        "skip such rows")
    items = [item for _, item in rollouts if (item.advantages is None) == rewarded]
    rewards = np.array([item.reward for item in items], dtype=np.float64)
    lengths = np.array([len(item.ids) for item in items], dtype=np.int64)
    lone = ()
    if rewarded:
        groups = [item.group for item in items]
        values, zero_std = group_advantages(rewards, groups, scale)
        advantages = np.concatenate([np.where(item.targets, value, 0.0) for item, value in zip(items, values)])
        lone = tuple(group for group, count in Counter(groups).items() if count == 1)
    else:
        zero_std = np.zeros(len(items), dtype=bool)
        advantages = np.concatenate([item.advantages for item in items])
    routes = None
    if any(item.routes is not None for item in items):
        shape = encoder.shape
        routes = np.concatenate([item.routes if item.routes is not None else
                                 np.full((len(item.ids), shape.moe_layers, shape.top_k), -1, dtype=np.int16)
                                 for item in items])
    template = "" if encoder.template is None else encoder.template.hash
    made = f"{source_fingerprint(source)}/{encoder.tokenizer.fingerprint}/{template}/rollouts/{scale}"
    return RolloutCorpus(np.concatenate([item.ids for item in items]),
                         np.concatenate([item.targets for item in items]),
                         np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                         np.array([item.prompt for item in items], dtype=np.int64),
                         np.concatenate([item.sampling for item in items]), advantages.astype(np.float32), routes,
                         rewards, zero_std, hashlib.blake2b(made.encode(), digest_size=8).hexdigest(),
                         len(encoded) - len(items), lone)
