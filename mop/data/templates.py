"""Chat templates: a conversation rendered with the model's own template, tokenized, and the mask of
its assistant tokens (the loss targets).

Rendering. The template is the tokenizer folder's (`chat_template.jinja`, else the `chat_template`
of `tokenizer_config.json`, a string or the entry named "default" of a list) or a file given
instead (`data.chat_template`). It is rendered with transformers' Jinja semantics (what
`apply_chat_template` does in transformers 4.57-5.x): an immutable sandboxed environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, `tojson` as `json.dumps` without
ASCII escaping, `raise_exception`, `strftime_now` (the local time), `namespace` and `dict`; the
variables `messages`, `tools`, `documents` (None), `add_generation_prompt` and the tokenizer's
special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`, as `tokenizer_config.json`
names them). As transformers does, message keys whose value is None are dropped and a message's
reasoning is offered under both `reasoning_content` and `thinking` (Qwen3's templates read the
first, gpt-oss's the second). The tokens are the rendered text encoded without added special
tokens: `apply_chat_template(..., tokenize=True)`'s ids.

Targets (`data.loss_on = "assistant"`). Templates rarely mark what the model generates (Qwen3's and
gpt-oss's have no `{% generation %}` blocks) and are not prefix-stable (both drop the reasoning of
earlier turns), so neither markers nor renderings of conversation prefixes are relied on. For
assistant message i of the rendering R:
1. what the message wrote: R is rendered again with that message's generated values perturbed
   (its content and reasoning strings, and every leaf of its tool calls' arguments, wrapped in
   private-use characters; tool names are kept, since templates repeat them in the tool results).
   The first and last characters where the two renderings differ bound what the message wrote.
   A template may cut a marker off with the text around it (Qwen3's splits a `<think>...</think>`
   block off the content, the opening marker with it): the renderings then differ by an insertion
   only, and both bounds are where it is (for Qwen3, the end of the content). Only identical
   renderings mean that the message renders nothing of its own;
2. where the turn starts: the template's generation prompt (the text `add_generation_prompt` adds
   after the messages before the first assistant turn: templates add the same text before every
   turn, so it is rendered once per conversation); the turn's targets start after its last
   occurrence before the first difference (and after the previous turn's targets), so a channel or think header the model
   writes itself (gpt-oss's `<|channel|>final<|message|>`, Qwen3's `<think>`) is a target while
   the role header is not. A template without a generation prompt starts the targets at the
   first difference;
3. where the turn ends: the first special token at or after the last difference (Qwen3's
   `<|im_end|>`, gpt-oss's `<|end|>`, `<|return|>` or `<|call|>`), inclusive; without one the
   targets end at the last difference.
A token is a target when its first character lies in a turn's span. The system prompt, user turns,
tool results and role headers never are. Cost: one rendering of the whole conversation per
assistant turn, plus the conversation's own and two of its opening.

With `data.loss_on = "all"` every token is a target. Every problem with a conversation is a
`ConversationError` naming its row, which the readers turn into a one-line `DataError` (or count
and skip with `data.skip_invalid`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mop.data.errors import DataError

OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters wrapped around perturbed values
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ConversationError(ValueError):
    """A conversation that cannot be rendered or trained on; the message says why, the reader adds where."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore attributes, as transformers' sandbox does."""

    def __init__(*args, **kwargs):  # jinja2.utils.Namespace's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store attribute {name!r} on a namespace")


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (the module docstring)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env.from_string(source)


def read_template(tokenizer_dir: Path | None, override: str = "") -> tuple[str, str]:
    """The chat template's text and where it came from: the file `override`, else the tokenizer
    folder's `chat_template.jinja`, else its `tokenizer_config.json`'s `chat_template`."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template: {path} is not a file; point it at a Jinja chat template")
        return path.read_text(encoding="utf-8"), str(path)
    if tokenizer_dir is None:
        raise DataError("data.format = 'chat' needs a chat template: set data.tokenizer to a Hugging Face tokenizer "
                        "folder with one, or data.chat_template to a template file")
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    config_file = tokenizer_dir / "tokenizer_config.json"
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template") if config_file.is_file() else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        raise DataError(f"data.tokenizer: {tokenizer_dir} has no chat template (no chat_template.jinja, no "
                        "chat_template in tokenizer_config.json); set data.chat_template to a template file")
    return template, str(config_file)


def template_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Conversation:
    """One row of a conversation source: messages (role, content, ...) and the tools it may call."""

    messages: list[dict]
    tools: list[dict] | None = None


def _prepared_messages(messages: list[dict]) -> list[dict]:
    """transformers' view of the messages: None values dropped, reasoning under every name."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _perturbed(value, names_kept: bool):
    """`value` with every string and number leaf wrapped in OPEN/CLOSE (a tool call's "name" kept)."""
    if isinstance(value, dict):
        return {k: v if names_kept and k == "name" else _perturbed(v, names_kept) for k, v in value.items()}
    if isinstance(value, list):
        return [_perturbed(v, names_kept) for v in value]
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return f"{OPEN}{value}{CLOSE}"
    return value


def _perturb_message(message: dict) -> dict:
    """The assistant message with what it generated perturbed (the module docstring, step 1)."""
    out = dict(message)
    for key in ("content", *REASONING_FIELDS):
        if isinstance(out.get(key), str) and out[key]:
            out[key] = _perturbed(out[key], True)
    if out.get("tool_calls"):
        out["tool_calls"] = _perturbed(copy.deepcopy(out["tool_calls"]), True)
    return out


def _difference(a: str, b: str) -> tuple[int, int]:
    """`(first, end)`: `a[first:end]` is where `a` differs from `b` (common prefix and suffix removed)."""
    limit = min(len(a), len(b))
    first = len(_common_prefix(a, b, limit))
    tail = len(_common_prefix(a[::-1], b[::-1], limit - first))
    return first, len(a) - tail


def _common_prefix(a: str, b: str, limit: int) -> str:
    # binary search on slice equality: C-speed comparisons, log(n) of them
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return a[:low]


class ChatTemplate:
    """A tokenizer and its chat template: `encode(conversation) -> (ids, targets)` (the module docstring)."""

    def __init__(self, source: str, origin: str, tokenizer, loss_on: str = "assistant"):
        self.source, self.origin, self.loss_on = source, origin, loss_on
        self.hash = template_hash(source)
        try:
            self._template = compile_template(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"data.chat_template: {origin} is not a valid Jinja template ({e.message}, line "
                            f"{e.lineno}); fix the template") from None
        self.tokenizer = tokenizer
        self._special_tokens = tokenizer.special_tokens_map()

    def render(self, conversation: Conversation, add_generation_prompt: bool = False, messages=None) -> str:
        messages = conversation.messages if messages is None else messages
        try:
            return self._template.render(messages=messages, tools=conversation.tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ConversationError(f"the chat template {self.origin} fails to render it ({e})") from None
        except (TypeError, AttributeError, KeyError, ValueError) as e:
            raise ConversationError(f"the chat template {self.origin} fails to render it "
                                    f"({type(e).__name__}: {e})") from None

    def encode(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and the target mask (bool) of one conversation."""
        conversation = Conversation(_prepared_messages(conversation.messages), conversation.tools)
        assistant = [i for i, m in enumerate(conversation.messages) if m.get("role") == "assistant"]
        if not assistant:
            raise ConversationError("it has no assistant turn")
        text = self.render(conversation)
        ids, starts = self.tokenizer.encode_with_starts(text)
        if self.loss_on == "all":
            return ids, np.ones(len(ids), dtype=bool)
        special = np.flatnonzero(np.isin(ids, list(self.tokenizer.special_ids)))
        targets = np.zeros(len(ids), dtype=bool)
        done = 0  # characters of `text` before which no later turn's targets start
        prompt = self._generation_prompt(conversation, assistant[0])
        for index in assistant:
            begin, end = self._turn_span(conversation, index, text, done, prompt)
            after = np.searchsorted(starts, end)  # the first token starting at or after the last difference
            closing = np.searchsorted(special, after)
            stop = int(special[closing]) + 1 if closing < len(special) else int(after)
            targets[np.searchsorted(starts, begin):stop] = True
            done = int(starts[stop - 1]) + 1
        return ids, targets

    def _turn_span(self, conversation: Conversation, index: int, text: str, done: int, prompt: str) -> tuple[int, int]:
        """Characters `[begin, end)` of `text`: from the turn's start to its last difference (steps 1-2)."""
        messages = list(conversation.messages)
        messages[index] = _perturb_message(messages[index])
        perturbed = self.render(conversation, messages=messages)
        if perturbed == text:
            raise ConversationError(f"message {index} (assistant) renders nothing of its own")
        first, end = _difference(text, perturbed)  # first == end: an insertion only (the module docstring)
        begin = first
        if prompt:
            at = text.rfind(prompt, done, first)
            if at >= 0:
                begin = at + len(prompt)
        return begin, end

    def _generation_prompt(self, conversation: Conversation, index: int) -> str:
        before = conversation.messages[:index]
        plain = self.render(conversation, messages=before)
        prompted = self.render(conversation, add_generation_prompt=True, messages=before)
        return prompted[len(plain):] if prompted.startswith(plain) else ""

    @cached_property
    def fingerprint(self) -> dict:
        """What a prepared folder records of the template and tokenizer that made it."""
        return {"template_sha256": self.hash, "tokenizer_fingerprint": self.tokenizer.fingerprint,
                "loss_on": self.loss_on}
