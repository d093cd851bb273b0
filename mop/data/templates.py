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

Assistant targets. Templates rarely mark what the model generates (Qwen3's and gpt-oss's have no
`{% generation %}` blocks) and are not prefix-stable (both drop the reasoning of earlier turns), so
neither markers nor renderings of conversation prefixes are relied on. For assistant message i of
the rendering R:
1. what the message wrote: the values it wrote (its content and reasoning, its tool calls'
   arguments; not the tool names, ids or types, which templates repeat in tool results or check)
   are wrapped in private-use characters and the conversation rendered again. Every turn gets a
   pair of its own in one rendering; where taking the markers out gives R back (the template wrote
   the strings as they are), the first and last marker of a turn bound what it wrote. Otherwise
   (a template that cuts or reformats a value, as Qwen3's splits a `<think>` block off the content),
   or for a turn without a string to mark, the turn is rendered alone with its values perturbed
   (numbers too) and the first and last characters where the two renderings differ bound it (an
   insertion only: both bounds where it is). A turn that writes nothing (empty content, no
   reasoning or tool call) has no target: what closes it cannot be told from the template's other
   special tokens (gpt-oss's `<|channel|>` comes first);
2. where the turn starts: after the last occurrence, before the first difference (and after the
   previous turn's targets), of the template's generation prompt (what `add_generation_prompt` adds
   after a user turn, rendered once per template), so a channel or think header the model writes
   itself (gpt-oss's `<|channel|>final<|message|>`, Qwen3's `<think>`) is a target while the role
   header is not. A template without a generation prompt starts the targets at the first difference;
3. where the turn ends: the first special token at or after the last difference (Qwen3's
   `<|im_end|>`, gpt-oss's `<|end|>`, `<|return|>` or `<|call|>`), inclusive. A template whose
   assistant turn is not closed by a special token before the next turn is refused when loaded (a
   two-turn probe conversation), since its targets could not be told from the next turn.
A token is a target when its first character lies in a turn's span. The system prompt, user turns,
tool results and role headers never are. Cost: two renderings of the conversation (one more per
turn the markers cannot place), linear in its length.

The targets kept are always the assistant's: `data.loss_on = "all"` is applied when sequences are
built (`mop.data.chat_packing`), so one encoding serves both, and the assistant turns' ends are the
turn boundaries that `data.overlong = "truncate"` cuts at either way. Every problem with a
conversation is a `ConversationError` naming its row, which the readers turn into a one-line
`DataError` (or count and skip with `data.skip_invalid`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
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


def _wrapped(value, opening: str, closing: str, numbers: bool):
    """`value` with its string leaves (and number leaves, with `numbers`) wrapped in the two markers."""
    if isinstance(value, dict):
        return {k: _wrapped(v, opening, closing, numbers) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrapped(v, opening, closing, numbers) for v in value]
    if isinstance(value, str) or (numbers and isinstance(value, (int, float)) and not isinstance(value, bool)):
        return f"{opening}{value}{closing}"
    return value


def _perturbed(message: dict, opening: str, closing: str, numbers: bool) -> dict:
    """The assistant message with what it wrote wrapped in markers: its content and reasoning, its tool
    calls' arguments (not their names, ids or types, which templates repeat or check)."""
    out = dict(message)
    for key in ("content", *REASONING_FIELDS):
        if isinstance(out.get(key), str) and out[key]:
            out[key] = _wrapped(out[key], opening, closing, numbers)
    if out.get("tool_calls"):
        calls = copy.deepcopy(out["tool_calls"])
        for call in calls:
            holder = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(holder, dict) and "arguments" in holder:
                holder["arguments"] = _wrapped(holder["arguments"], opening, closing, numbers)
        out["tool_calls"] = calls
    return out


def _markers(index: int) -> tuple[str, str]:
    """Message `index`'s own pair of supplementary private-use characters."""
    return chr(_MARKER_BASE + 2 * index), chr(_MARKER_BASE + 2 * index + 1)


_MARKER_BASE = 0xF0000
_MARKER = re.compile("[\U000F0000-\U000FFFFD]")
_PROBE = [{"role": "user", "content": "mop probe one"}, {"role": "assistant", "content": "mop answer one"},
          {"role": "user", "content": "mop probe two"}, {"role": "assistant", "content": "mop answer two"}]


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
    """A tokenizer and its chat template: `encode(conversation) -> (ids, assistant targets)` (the
    module docstring). Checks once that the template ends an assistant turn with a special token
    before the next turn (`_check_turn_ends`): the targets could not be told from the next turn
    otherwise."""

    def __init__(self, source: str, origin: str, tokenizer):
        self.source, self.origin = source, origin
        self.hash = template_hash(source)
        try:
            self._template = compile_template(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"data.chat_template: {origin} is not a valid Jinja template ({e.message}, line "
                            f"{e.lineno}); fix the template") from None
        self.tokenizer = tokenizer
        self._special_tokens = tokenizer.special_tokens_map()
        self._special_ids = np.asarray(sorted(tokenizer.special_ids), dtype=np.int64)
        self._prompt = self._generation_prompt()
        self._check_turn_ends()

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
        """Token ids (int64) and the assistant targets (bool) of one conversation."""
        conversation = Conversation(_prepared_messages(conversation.messages), conversation.tools)
        assistant = [i for i, m in enumerate(conversation.messages) if m.get("role") == "assistant"]
        if not assistant:
            raise ConversationError("it has no assistant turn")
        text = self.render(conversation)
        ids, starts = self.tokenizer.encode_with_starts(text)
        special = np.flatnonzero(np.isin(ids, self._special_ids))
        targets = np.zeros(len(ids), dtype=bool)
        done = 0  # characters of `text` before which no later turn's targets start
        for index, span in zip(assistant, self._differences(conversation, assistant, text)):
            if span is None:  # the turn writes nothing: no target, and the next turn starts after its prompt
                at = text.find(self._prompt, done) if self._prompt else -1
                done = done if at < 0 else at + len(self._prompt)
                continue
            begin, end = self._turn_start(text, done, span[0]), span[1]
            after = np.searchsorted(starts, end)  # the first token starting at or after the last difference
            closing = np.searchsorted(special, after)
            stop = int(special[closing]) + 1 if closing < len(special) else int(after)
            targets[np.searchsorted(starts, begin):stop] = True
            done = int(starts[stop - 1]) + 1 if stop else done
        return ids, targets

    def _differences(self, conversation: Conversation, assistant: list[int], text: str) -> list[tuple[int, int] | None]:
        """Each assistant turn's first and last differing characters (step 1), None where nothing
        differs. One rendering with every turn's strings wrapped in markers of its own, when taking
        the markers out gives `text` back (the template wrote the strings as they are); otherwise,
        or for a turn without a marked string, one rendering per turn with its values perturbed."""
        messages = list(conversation.messages)
        for index in assistant:
            messages[index] = _perturbed(messages[index], *_markers(index), numbers=False)
        marked = self.render(conversation, messages=messages)
        found: dict[int, list[int]] = {}
        if _MARKER.sub("", marked) == text:
            for count, match in enumerate(_MARKER.finditer(marked)):
                index = (ord(match.group()) - _MARKER_BASE) // 2
                found.setdefault(index, []).append(match.start() - count)  # its place in `text`
        return [(min(found[i]), max(found[i])) if i in found else self._difference_alone(conversation, i, text)
                for i in assistant]

    def _difference_alone(self, conversation: Conversation, index: int, text: str) -> tuple[int, int] | None:
        messages = list(conversation.messages)
        messages[index] = _perturbed(messages[index], OPEN, CLOSE, numbers=True)
        perturbed = self.render(conversation, messages=messages)
        return None if perturbed == text else _difference(text, perturbed)

    def _turn_start(self, text: str, done: int, first: int) -> int:
        """Where in `text` a turn's targets start: after its generation prompt (step 2), else at its
        first difference."""
        at = text.rfind(self._prompt, done, first) if self._prompt else -1
        return first if at < 0 else at + len(self._prompt)

    def _generation_prompt(self) -> str:
        """What `add_generation_prompt` adds after a user turn ("" where it adds nothing, or where the
        template cannot render a lone user turn)."""
        probe = Conversation(_PROBE[:1])
        try:
            plain, prompted = self.render(probe), self.render(probe, add_generation_prompt=True)
        except ConversationError:
            return ""
        return prompted[len(plain):] if prompted.startswith(plain) else ""

    def _check_turn_ends(self) -> None:
        """The first turn of a two-turn probe must end (its special token) before the second user turn."""
        try:
            ids, targets = self.encode(Conversation(_PROBE))
            text = self.render(Conversation(_PROBE))
        except ConversationError:
            return  # the template needs more than the probe (a system prompt, tools): nothing to judge
        _, starts = self.tokenizer.encode_with_starts(text)
        second_user = np.searchsorted(starts, text.index(_PROBE[2]["content"]))
        if targets[second_user]:
            raise DataError(f"data.chat_template: {self.origin} ends an assistant turn with no special token of "
                            f"{self.tokenizer.name} (the targets would run into the next turn); use a template "
                            "whose turns end with one (<|im_end|>, <|end|>, ...) or a tokenizer that marks it special")

