"""Recorded rollouts (reinforcement learning, issue 47): rows read, checked and encoded into tokens,
targets and the per-token values a policy-gradient objective needs (`RolloutRows`; gathered into a
corpus by `mop.data.rollouts.corpus`).

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
  with each other), from which mop computes GRPO's advantages (`mop.data.rollouts.corpus`);
- optionally `routed_experts`: the experts each token was routed to at sampling time (routing
  replay). vLLM's form: `[tokens - 1, layers, top_k]` (nested lists, or base64 of a `.npy` file as
  vLLM's HTTP API sends it), SGLang's: base64 of little-endian int32 (`meta_info["routed_experts"]`)
  reshaped to `(-1, layers, top_k)`; rows from token `routed_experts_start` on (vLLM's
  `routed_experts_prompt_start`, SGLang's `routed_experts_start_len`; default 0). `layers` is the
  model's layer count (the dense layers' rows, zeros in both engines, are ignored) or its MoE layer
  count. The last token has no row (the engine never fed it through the model): it routes itself,
  as do tokens before the start.

A bad row is a `ConversationError` the reader names by file and row (or counts and skips with
`data.skip_invalid`): a missing or mistyped field, an empty prompt or completion, a completion
without a target, lengths that disagree (`completion_mask`, `sampling_logps`, a per-token
`advantage`, routes for another number of tokens), a non-finite advantage or reward, a sampling
log-prob that is NaN (null is "unknown"), infinite or above 0 (past `LOGP_ROUNDING`), route
payloads that are not a readable `.npy` nor raw int32 of exactly the tokens' size, an expert id out
of range, routes for another layer count or top-k, a row that mixes advantages and rewards with the
rest of the source.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import numpy as np

from mop.data.conversations import message_list, parse_row, present_fields, row_tools
from mop.data.errors import ConversationError, DataError
from mop.data.templates import ChatTemplate, Conversation
from mop.data.tokenizer import AnyTokenizer


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
