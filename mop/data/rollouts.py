"""Recorded rollouts (reinforcement learning, issue 47): rows read, checked and encoded into tokens,
targets and the per-token values a policy-gradient objective needs (`RolloutCorpus`).

A row (jsonl, parquet or folders of them: the readers of chat sources, `mop.data.conversations`):
- the sequence, either as token ids, `prompt_ids` and `completion_ids` as the engine returned them,
  with an optional `completion_mask` (1 on the tokens the policy generated, 0 on tool or environment
  output inside the completion: context, never targets); or as messages, `prompt` and `completion`
  lists rendered with the chat template (`mop.data.templates`: the completion's assistant targets
  are the policy's tokens, tool results context; the prompt's tokens must begin the whole
  rendering's, as for preference pairs);
- `sampling_logps`: the engine's log-probability of each generated token (one per target, in order;
  null: unknown, no train-inference correction for it; absent: none known);
- the learning signal, one of: `advantage` (a number for the whole completion, or one per target);
  or `reward` (a number, null: unscorable) with `group` (the prompt's id: its rollouts are compared
  with each other), from which mop computes GRPO's advantages (`group_advantages`);
- optionally `routed_experts`: the experts each token was routed to at sampling time (routing
  replay). vLLM's form: `[tokens - 1, layers, top_k]` (nested lists, or base64 of a `.npy` file as
  vLLM's HTTP API sends it), SGLang's: base64 of little-endian int32 (`meta_info["routed_experts"]`)
  reshaped to `(-1, layers, top_k)`; rows from token `routed_experts_start` on (vLLM's
  `routed_experts_prompt_start`, SGLang's `routed_experts_start_len`; default 0). `layers` is the
  model's layer count (the dense layers' rows, zeros in both engines, are ignored) or its MoE layer
  count. The last token has no row (the engine never fed it through the model): it routes itself,
  as do tokens before the start.

Advantages from rewards (TRL 1.16's `_generate_and_score_completions`): per group, the mean of its
known rewards; `scale_rewards` "group" divides by the group's unbiased standard deviation + 1e-4,
"batch" by that of every known reward of the source + 1e-4 (TRL takes the generation batch's: the
source is mop's batch), "none" by nothing; an unscorable rollout, or one whose group has one known
reward, gets 0. A rollout "has zero std" (`frac_reward_zero_std`) when the std it is scaled by is 0
(for "none", its group's; a group of one rollout has std 0, as TRL's for one generation). Such lone
groups train nothing but the KL (TRL refuses fewer than 2 generations): the corpus names them
(`lone_groups`) and a run warns once at its start.

A bad row is a `ConversationError` the reader names by file and row (or counts and skips with
`data.skip_invalid`): a missing or mistyped field, an empty prompt or completion, a completion
without a target, lengths that disagree (`completion_mask`, `sampling_logps`, a per-token
`advantage`, routes for another number of tokens), a non-finite advantage or reward, a sampling
log-prob that is NaN (null is "unknown"), infinite or above 0 (past `LOGP_ROUNDING`), route
payloads that are not a readable `.npy` nor raw int32 of exactly the tokens' size, an expert id out
of range, routes for another layer count or top-k, a row that mixes advantages and rewards with the
rest of the source.

Encoded (`RolloutCorpus`, held in memory: an RL step's rollouts are a file of one batch, not a
pre-training corpus; `mop data prepare` does not take them): rollout k is `tokens[offsets[k]:
offsets[k+1]]`, its prompt's `prompts[k]` tokens first; per token `targets` (the generated
completion tokens), `sampling` (float32, NaN but on targets), `advantages` (float32, 0 but on
targets), `routes` (int16 `[T, moe_layers, top_k]`, -1: none; None when no row has any).
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mop.data.conversations import (
    chat_files,
    iter_rows,
    message_list,
    parse_row,
    present_fields,
    row_tools,
)
from mop.data.errors import ConversationError, DataError
from mop.data.prepared import encode_rows, is_prepared, source_fingerprint
from mop.data.templates import ChatTemplate, Conversation
from mop.data.tokenizer import AnyTokenizer

ScaleRewards = Literal["group", "batch", "none"]
STD_EPSILON = 1e-4  # TRL's, added to the std an advantage is divided by


@dataclass(frozen=True)
class RouteShape:
    """What a row's routed experts must fit: the model's layers, its first `dense_layers` without
    experts, its `experts` and `top_k`."""

    layers: int
    dense_layers: int
    experts: int
    top_k: int

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


@dataclass(frozen=True)
class RolloutSettings:
    """What a run's recorded rollouts are read with beyond the chat settings."""

    shape: RouteShape
    scale_rewards: ScaleRewards = "group"
    sequences: int = 0
    """The packed sequences served (the RL loop's fixed global batch: empty ones pad the packing to it);
    0: as many as the rollouts fill."""


@dataclass(frozen=True)
class Rollout:
    """One encoded row (module docstring): the item, its values per token and its signal."""

    ids: np.ndarray
    targets: np.ndarray
    prompt: int
    sampling: np.ndarray
    advantages: np.ndarray | None
    """Per token (0 but on targets), None for a row with a reward instead."""
    reward: float
    group: str | None
    routes: np.ndarray | None


class RolloutRows:
    """Rollout rows -> `Rollout`s (module docstring); `template` None: token-id rows only."""

    def __init__(self, tokenizer: AnyTokenizer, template: ChatTemplate | None, shape: RouteShape):
        self.tokenizer, self.template, self.shape = tokenizer, template, shape

    def __call__(self, row) -> Rollout:
        row = parse_row(row, "'prompt_ids' and 'completion_ids', or 'prompt' and 'completion'")
        ids, targets, prompt = self._sequence(row)
        sampling = np.full(len(ids), np.nan, dtype=np.float32)
        if row.get("sampling_logps") is not None:
            sampling[targets] = _logps(row["sampling_logps"], int(targets.sum()))
        advantages, reward, group = _signal(row, targets)
        routes = None if row.get("routed_experts") is None else _routes(row, len(ids), self.shape)
        return Rollout(ids, targets, prompt, sampling, advantages, reward, group, routes)

    def _sequence(self, row: dict) -> tuple[np.ndarray, np.ndarray, int]:
        if row.get("prompt_ids") is not None or row.get("completion_ids") is not None:
            prompt = _ids(row, "prompt_ids", self.tokenizer.vocab_size)
            completion = _ids(row, "completion_ids", self.tokenizer.vocab_size)
            generated = np.ones(len(completion), dtype=bool)
            if row.get("completion_mask") is not None:
                generated = _numbers(row["completion_mask"], "completion_mask", len(completion)) != 0
            targets = np.concatenate([np.zeros(len(prompt), dtype=bool), generated])
            ids = np.concatenate([prompt, completion])
        elif row.get("prompt") is not None and row.get("completion") is not None:
            ids, targets, prompt = self._rendered(row)
        else:
            raise ConversationError("it has neither 'prompt_ids' and 'completion_ids' nor 'prompt' and 'completion' "
                                    f"(fields: {present_fields(row)})")
        if not targets.any():
            raise ConversationError("its completion has no generated token (completion_mask all 0, or no assistant "
                                    "turn)")
        return ids, targets, len(prompt) if isinstance(prompt, np.ndarray) else prompt

    def _rendered(self, row: dict) -> tuple[np.ndarray, np.ndarray, int]:
        if self.template is None:
            raise DataError("data.tokenizer: rollouts as messages are rendered with a chat template; set "
                            "data.tokenizer to a Hugging Face tokenizer folder with one, or data.chat_template")
        prompt, completion = message_list(row["prompt"], "prompt"), message_list(row["completion"], "completion")
        tools = row_tools(row)
        prompt_ids = self.template.encode_prompt(Conversation(prompt, tools))
        ids, targets = self.template.encode(Conversation(prompt + completion, tools))
        p = len(prompt_ids)
        if len(ids) <= p or not np.array_equal(ids[:p], prompt_ids):
            raise ConversationError(f"its prompt's {p} tokens are not the first tokens of prompt + completion (the "
                                    "template renders the prompt otherwise before an answer); send token ids instead")
        targets = np.array(targets, dtype=bool)
        targets[:p] = False
        return np.asarray(ids, dtype=np.int64), targets, p


def _ids(row: dict, field: str, vocab: int) -> np.ndarray:
    ids = _numbers(row.get(field), field, None)
    if not len(ids):
        raise ConversationError(f"its {field!r} is empty")
    if not np.all(np.mod(ids, 1) == 0) or ids.min() < 0 or ids.max() >= vocab:
        raise ConversationError(f"its {field!r} holds a value that is not a token id of the tokenizer's {vocab}")
    return ids.astype(np.int64)


def _numbers(value, field: str, length: int | None, allow_null: bool = False) -> np.ndarray:
    """A row's list of finite numbers (null entries NaN where allowed, a NaN refused: null is how a
    row says a value is unknown), of `length` where given."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise ConversationError(f"its {field!r} is a {type(value).__name__}, not a list of numbers")
    nulls = np.array([v is None for v in value], dtype=bool)
    if nulls.any() and not allow_null:
        raise ConversationError(f"its {field!r} holds a null")
    try:
        array = np.array([np.nan if v is None else v for v in value], dtype=np.float64)
    except (TypeError, ValueError):
        raise ConversationError(f"its {field!r} holds something that is not a number") from None
    if length is not None and len(array) != length:
        raise ConversationError(f"its {field!r} has {len(array)} values for {length} generated completion tokens")
    if not np.isfinite(array[~nulls]).all():
        unknown = "; an unknown value is null" if allow_null else ""
        raise ConversationError(f"its {field!r} holds a non-finite value "
                                f"({array[~nulls][~np.isfinite(array[~nulls])][0]}){unknown}")
    return array


LOGP_ROUNDING = 1e-3
"""How far above 0 a sampling log-prob may be: the engines compute log-probs in fp32 from the logits
(bf16 ones on GPUs), whose rounding puts a near-certain token at most ~1e-5 above 0; more is not a
log-probability (a probability, a logit, a flipped sign)."""


def _logps(value, generated: int) -> np.ndarray:
    """A row's `sampling_logps`: one per generated token, null where unknown, none above 0 (past
    `LOGP_ROUNDING`)."""
    logps = _numbers(value, "sampling_logps", generated, allow_null=True)
    above = np.flatnonzero(logps > LOGP_ROUNDING)
    if len(above):
        raise ConversationError(f"its 'sampling_logps' holds {logps[above[0]]:.6g} for generated token "
                                f"{above[0]}: a log-probability is at most 0 (rounding allowed to "
                                f"{LOGP_ROUNDING:g}); send the engine's log-probs of the sampled tokens, not "
                                "probabilities or logits")
    return logps


def _signal(row: dict, targets: np.ndarray) -> tuple[np.ndarray | None, float, str | None]:
    """`(advantages per token or None, reward, group)` of a row."""
    if row.get("advantage") is not None:
        value = row["advantage"]
        advantages = np.zeros(len(targets), dtype=np.float32)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConversationError(f"its 'advantage' is not finite ({value})")
            advantages[targets] = value
        else:
            advantages[targets] = _numbers(value, "advantage", int(targets.sum()))
        return advantages, math.nan, None
    if "reward" not in row or row.get("group") is None:
        raise ConversationError(f"it has neither an 'advantage' nor a 'reward' with a 'group' (fields: "
                                f"{present_fields(row)})")
    reward = row["reward"]
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ConversationError(f"its 'reward' is not a finite number or null ({reward!r})")
    return None, math.nan if reward is None else float(reward), str(row["group"])


def _routes(row: dict, tokens: int, shape: RouteShape) -> np.ndarray:
    """`[tokens, moe_layers, top_k]` int16 (-1: none) from a row's `routed_experts` (module docstring)."""
    start = row.get("routed_experts_start") or 0
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < tokens:
        raise ConversationError(f"its 'routed_experts_start' is not a token index of its {tokens} tokens ({start!r})")
    recorded = _route_array(row["routed_experts"], shape, tokens - 1 - start)
    layers = (shape.layers, shape.moe_layers)
    if recorded.ndim != 3 or recorded.shape[1] not in layers or recorded.shape[2] != shape.top_k:
        raise ConversationError(f"its 'routed_experts' has shape {list(recorded.shape)}; the model needs [tokens - 1, "
                                f"{shape.layers} layers (or {shape.moe_layers} MoE layers), top_k {shape.top_k}]")
    if start + len(recorded) != tokens - 1:
        raise ConversationError(f"its 'routed_experts' has {len(recorded)} rows from token {start} for {tokens} tokens "
                                f"(the engines send tokens - 1 - start = {tokens - 1 - start})")
    if recorded.shape[1] == shape.layers:
        recorded = recorded[:, shape.dense_layers:]
    if len(recorded) and (recorded.min() < 0 or recorded.max() >= shape.experts):
        raise ConversationError(f"its 'routed_experts' holds an expert id outside [0, {shape.experts})")
    if (np.diff(np.sort(recorded, axis=-1), axis=-1) == 0).any():
        raise ConversationError("its 'routed_experts' names an expert twice among a token's top_k")
    routes = np.full((tokens, shape.moe_layers, shape.top_k), -1, dtype=np.int16)
    routes[start:tokens - 1] = recorded
    return routes


def _route_array(value, shape: RouteShape, rows: int) -> np.ndarray:
    """Nested lists, base64 of a `.npy` (vLLM) or base64 of raw int32 (SGLang) as an integer array; raw
    int32 must hold the `rows` the sequence needs for either layer count, and is shaped by it."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            raise ConversationError("its 'routed_experts' is a string but not base64") from None
        return _npy_routes(raw) if raw.startswith(_NPY_MAGIC) else _raw_routes(raw, shape, rows)
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConversationError("its 'routed_experts' is not a [tokens - 1, layers, top_k] array of expert "
                                "ids") from None
    if not np.all(np.mod(array, 1) == 0):
        raise ConversationError("its 'routed_experts' holds a value that is not an expert id")
    return array.astype(np.int64)


_NPY_MAGIC = b"\x93NUMPY"


def _npy_routes(raw: bytes) -> np.ndarray:
    """vLLM's form: a whole `.npy` file of integer expert ids."""
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise ConversationError(f"its 'routed_experts' is a .npy file that cannot be read, cut short or corrupt "
                                f"({e}); send the engine's whole .npy of expert ids") from None
    if array.dtype.kind not in "iu":
        raise ConversationError(f"its 'routed_experts' is a .npy of {array.dtype}, not of integer expert ids")
    return array.astype(np.int64)


def _raw_routes(raw: bytes, shape: RouteShape, rows: int) -> np.ndarray:
    """SGLang's form: little-endian int32, exactly `rows` x layers x top_k of them (either layer count)."""
    for layers in dict.fromkeys((shape.layers, shape.moe_layers)):
        if len(raw) == 4 * rows * layers * shape.top_k:
            return np.frombuffer(raw, dtype="<i4").astype(np.int64).reshape(rows, layers, shape.top_k)
    needed = " or ".join(f"{4 * rows * layers * shape.top_k} bytes ({layers} layers)"
                         for layers in dict.fromkeys((shape.layers, shape.moe_layers)))
    raise ConversationError(f"its 'routed_experts' is base64 of {len(raw)} bytes that are neither a .npy file (no "
                            f".npy header) nor raw int32 of its {rows} routed tokens (tokens - 1 - "
                            f"routed_experts_start) x layers x top_k {shape.top_k}: {needed}; send vLLM's .npy or "
                            "SGLang's raw little-endian int32")


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
