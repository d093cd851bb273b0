"""Preference pairs (DPO, issue 39): TRL's rows read and encoded into prompt, chosen and rejected tokens.

Rows (TRL 1.16's formats), from the readers of chat sources (`mop.data.conversations`: jsonl,
parquet, folders of them, `datasets` folders):
- explicit: `prompt`, `chosen` and `rejected`;
- implicit: `chosen` and `rejected` only. The prompt is their longest common prefix (TRL's
  `extract_prompt`): by message for message lists; by character for strings, moved back one
  character when the one before the divergence is a space (the space goes to the responses: "The
  sky is blue." and "The sky is green." give the prompt "The sky is"). Where one response is a
  prefix of the other, the prompt is the first one less its last element (TRL's loop runs out).
  Where they differ from the start the prompt is empty and the row refused (TRL's index wraps
  around: "a b " and "b" would give the prompt "a b").
All three are message lists (`{role, content, ...}`: "conversational") or all strings ("plain");
TRL decides from a dataset's first row, mop row by row. An optional `tools` (a list of JSON schemas,
or a JSON string of one) goes to the template, as for chat rows. TRL's `chat_template_kwargs` would
change the rendering: a row with them is refused.

Encoding (TRL's `tokenize_fn`). Conversational, with the chat template (`mop.data.templates`):
`prompt_ids` = the prompt rendered with the generation prompt; for each response, `ids, targets =
template.encode(prompt + response)`, the response is `ids[p:]` and its targets `targets[p:]`: the
assistant targets (issue 36) of the response alone. TRL trains every token after the prompt (for
Qwen3 also the newline after `<|im_end|>`): that is `data.loss_on = "all"`, applied when pairs are
packed (`mop.data.preference.packing`), so one encoding serves both. Plain: `prompt_ids =
encode(prompt)` and `ids = encode(prompt + response + EOS)`, one text, the tokenizer's EOS token's
text appended unless the response ends with it (the byte tokenizer, which reads no special token's
text, gets its EOS id appended instead); every response token is a target. No special tokens are
added (TRL's tokenizer call adds a BOS where the tokenizer's post-processor does: none for Qwen3 or
gpt-oss). Plain rows need only a tokenizer; conversational ones a chat template.

Invariant: the prompt's tokens are the first tokens of prompt + chosen and of prompt + rejected, so
both responses continue one tokenization of the prompt, which packing it once needs. TRL instead
cuts the prompt at the common prefix of the three tokenizations and only warns; mop refuses such a
row (a template that renders the prompt otherwise before an answer, a token spanning the boundary).

Every unusable row is a `ConversationError` that the reader names by file and row (or counts and
skips with `data.skip_invalid`): a field missing or of another type, a mix of strings and message
lists, an empty prompt (mop needs at least one prompt token: its last one predicts each response's
first), a response that adds no token (or, conversational, no assistant target) after the prompt,
and the prefix rule above; with `data.skip_invalid` also a degenerate pair (`same_responses`), which is
otherwise kept and counted. An encoded pair is `(ids, targets, (p, c, r))`: `ids` the prompt, chosen
and rejected tokens one after the other (int64), `targets` False on the prompt, p, c, r >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mop.data.bisection import common_prefix
from mop.data.conversations import message_list, parse_row, present_fields, row_tools
from mop.data.errors import ConversationError, DataError
from mop.data.templates import ChatTemplate, Conversation
from mop.data.tokenizer import AnyTokenizer, ByteTokenizer

RESPONSES = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference row: its prompt and two responses, all message lists or all strings."""

    prompt: list[dict] | str
    chosen: list[dict] | str
    rejected: list[dict] | str
    tools: list[dict] | None = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def pair(row) -> Pair:
    """The pair of one row, a dict or a JSON line (the module docstring)."""
    row = parse_row(row, "'chosen' and 'rejected'")
    missing = [repr(field) for field in RESPONSES if row.get(field) is None]
    if missing:
        raise ConversationError(f"it has no {' or '.join(missing)} (fields: {present_fields(row)})")
    if row.get("chat_template_kwargs"):
        raise ConversationError("it has 'chat_template_kwargs', which mop does not pass to the template; drop them")
    fields = {field: row[field] for field in ("prompt", *RESPONSES) if row.get(field) is not None}
    kinds = {field: _kind(value, field) for field, value in fields.items()}
    if len(set(kinds.values())) > 1:
        found = ", ".join(f"{field}: {kind}" for field, kind in kinds.items())
        raise ConversationError(f"it mixes strings and message lists ({found})")
    conversational = kinds["chosen"] == "messages"
    if conversational:
        fields = {field: message_list(value, field) for field, value in fields.items()}
    explicit = "prompt" in fields
    prompt, chosen, rejected = (fields["prompt"], fields["chosen"], fields["rejected"]) if explicit else \
        extract_prompt(fields["chosen"], fields["rejected"])
    if not prompt:
        raise ConversationError("its 'prompt' is empty" if explicit else
                                "its implicit prompt is empty (chosen and rejected differ from the start)")
    return Pair(prompt, chosen, rejected, row_tools(row) if conversational else None)


def _kind(value, field: str) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "messages"
    raise ConversationError(f"its {field!r} is a {type(value).__name__}, not a string or a list of messages")


def extract_prompt(chosen, rejected) -> tuple:
    """`(prompt, chosen, rejected)` from two responses that hold the prompt (TRL's `extract_prompt`,
    the module docstring)."""
    shortest = min(len(chosen), len(rejected))
    common = common_prefix(chosen, rejected)
    if common == shortest:  # no divergence: TRL's loop ends on its last index (none for an empty response)
        cut = max(shortest - 1, 0)
    else:
        cut = common - 1 if common > 0 and chosen[common - 1] == " " else common
    return chosen[:cut], chosen[cut:], rejected[cut:]


class PreferenceRows:
    """Preference rows -> encoded pairs `(ids, targets, (p, c, r))` (the module docstring); the template
    is None where data.tokenizer has none (plain rows only). With `drop_degenerate` a pair whose
    responses are the same tokens is refused like an unusable row (`data.skip_invalid` drops them)."""

    def __init__(self, tokenizer: AnyTokenizer, template: ChatTemplate | None, drop_degenerate: bool = False):
        self.tokenizer, self.template, self.drop_degenerate = tokenizer, template, drop_degenerate

    def __call__(self, row) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
        ids, targets, parts = encode_pair(pair(row), self.tokenizer, self.template)
        if self.drop_degenerate and same_responses(ids, parts):
            raise ConversationError(f"its chosen and rejected responses are the same {parts[1]} tokens (a degenerate "
                                    "pair)")
        return ids, targets, parts


def same_responses(ids: np.ndarray, parts) -> bool:
    """Whether an encoded pair's chosen and rejected responses are the same tokens: a degenerate pair,
    whose log-ratios cancel whatever the weights (DPO's loss ln 2 with beta's sigmoid, no gradient, a
    miss in rewards/accuracies, which counts only a chosen reward above the rejected). TRL 1.16 trains
    such pairs without a word; mop counts them and warns (`PreferenceDataset.stats`)."""
    p, c, r = (int(n) for n in parts)
    return c == r and bool(np.array_equal(ids[p:p + c], ids[p + c:p + c + r]))


def encode_pair(pair: Pair, tokenizer: AnyTokenizer, template: ChatTemplate | None):
    """A pair's `(ids, targets, (p, c, r))` (the module docstring)."""
    if pair.conversational:
        if template is None:
            raise DataError("data.tokenizer: conversational preference rows are rendered with a chat template; set "
                            "data.tokenizer to a Hugging Face tokenizer folder with one, or data.chat_template")
        prompt = _rendered("its prompt", template.encode_prompt, Conversation(pair.prompt, pair.tools))
        full = [_rendered(f"prompt + {name}", template.encode, Conversation(pair.prompt + response, pair.tools))
                for name, response in zip(RESPONSES, (pair.chosen, pair.rejected))]
    else:
        prompt = np.asarray(tokenizer.encode(pair.prompt), dtype=np.int64)
        full = [_every_token(_with_eos(tokenizer, pair.prompt + response)) for response in (pair.chosen, pair.rejected)]
    if not len(prompt):
        raise ConversationError("its prompt has no tokens")
    (chosen, chosen_targets), (rejected, rejected_targets) = (_response(prompt, ids, targets, name)
                                                            for (ids, targets), name in zip(full, RESPONSES))
    ids = np.concatenate([prompt, chosen, rejected])
    targets = np.concatenate([np.zeros(len(prompt), dtype=bool), chosen_targets, rejected_targets])
    return ids, targets, (len(prompt), len(chosen), len(rejected))


def _rendered(what: str, encode, conversation: Conversation):
    """`encode(conversation)`, its ConversationError saying which rendering of the pair failed."""
    try:
        return encode(conversation)
    except ConversationError as e:
        raise ConversationError(f"{what}: {e}") from None


def _with_eos(tokenizer: AnyTokenizer, text: str) -> np.ndarray:
    """`text` + EOS as one text, tokenized (the module docstring)."""
    eos = tokenizer.decode([tokenizer.eos_id], special=True)
    if isinstance(tokenizer, ByteTokenizer):
        return np.asarray(tokenizer.encode(text.removesuffix(eos)) + [tokenizer.eos_id], dtype=np.int64)
    return np.asarray(tokenizer.encode(text if text.endswith(eos) else text + eos), dtype=np.int64)


def _every_token(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ids, np.ones(len(ids), dtype=bool)


def _response(prompt: np.ndarray, ids: np.ndarray, targets: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of prompt + response after the prompt's, and their targets (the module docstring)."""
    p = len(prompt)
    shared = min(p, len(ids))
    differ = np.flatnonzero(ids[:shared] != prompt[:shared])
    if len(differ) or len(ids) < p:
        at = int(differ[0]) if len(differ) else shared
        raise ConversationError(f"its prompt's {p} tokens are not the first tokens of prompt + {name} (they differ at "
                                f"token {at}: the prompt renders otherwise before an answer, or a token spans the "
                                "boundary); TRL would move the boundary, mop refuses the row")
    response, trained = ids[p:], targets[p:]
    if not len(response):
        raise ConversationError(f"its {name} response adds no tokens after the prompt")
    if not trained.any():
        raise ConversationError(f"its {name} response has no assistant target (no assistant turn after the prompt)")
    return response, trained
