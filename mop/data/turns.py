"""Where the model writes in a chat template's rendering: each assistant turn's span of characters,
for templates that do not mark it themselves with `{% generation %}` blocks.

A turn's targets are everything the model writes in it: its reasoning, content and tool calls from
their opening text (the names, ids and arguments it writes) through the template's own end of the
turn, the token or text generation stops on (Qwen3's `<|im_end|>`, gpt-oss's `<|end|>`, `<|call|>`
or `<|return|>`, DeepSeek's `<｜end▁of▁sentence｜>`). Not the role header before it, the separator
after it (Qwen3's newline after `<|im_end|>`), nor any system, user or tool turn. Which tokens a
tokenizer flags special plays no part: everything comes from renderings of the conversation.

For assistant message i of a conversation rendered as R:
1. values: every message's strings (content, reasoning, tool-call argument strings, tool results)
   are wrapped in private-use characters of its own and the conversation rendered once; where taking
   them out gives R back, a message's first and last marks bound its values in R. Otherwise (a
   template that cuts or reformats a value, as Qwen3 splits a `<think>` block off the content) they
   are where R and a rendering with that message's values perturbed differ;
2. start: the model starts writing turn i where the rendering of `messages[:i]` with the generation
   prompt, P, ends: at the end of the longest end of P found in R between the previous turn's end and
   turn i's first value (the last place it is found). When P cannot be rendered (a template that
   needs a first message), the generation prompt stands for it;
3. end: the rendering of `messages[:i + 1]` with the generation prompt, Q, shows the turn followed by
   nothing but the next turn's prompt. The turn ends where the longest end of Q before that prompt is
   first found in R from the turn's start to the next message's first value, trailing whitespace left
   out (Qwen3's newline after `<|im_end|>`); that end must cover everything after the turn's last value
   in R. The conversation's last message ends where R does, trailing whitespace left out;
4. a template that closes an assistant turn with no text of its own (GLM-4.5, whose generation
   stops on the next message's `<|user|>` or `<|observation|>`, the token its own fine-tuning code
   trains) has each turn extended through the first character of what follows it, so the token
   holding it is a target; the conversation's last turn has none.
Why prefix renderings, matched by their ends, and not one rendering with markers alone: templates are
not prefix-stable (Qwen3 and gpt-oss drop earlier turns' reasoning, gpt-oss ends the last turn with
`<|return|>` and earlier ones with `<|end|>`), a turn's header differs with what precedes it
(DeepSeek-V3.1 writes none after a tool result; Mistral's `[INST]` templates have no generation
prompt), and a tool call's opening text, name and id are written by the model but checked or
repeated by templates, so they cannot be marked. P and Q agree with R right before a turn starts and
right before it ends, whatever they render differently earlier. A turn whose start or end is not
found so is a `ConversationError` saying to mark the template's assistant text with `{% generation %}`
blocks. Cost: two renderings of the conversation and two of its prefix up to each assistant turn (one
more per message whose values the markers cannot place); each match a binary search of `str.find`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

from mop.data.errors import ConversationError

Render = Callable[[list[dict], bool], str]
"""Renders messages with the conversation's tools, with or without the generation prompt."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters wrapped around perturbed values
_MARKER_BASE = 0xF0000  # message j's values are wrapped in chr(base + 2j) ... chr(base + 2j + 1)
_MARKER = re.compile("[\U000F0000-\U000FFFFD]")
_MAX_MARKED = (0xFFFFD - _MARKER_BASE) // 2  # messages that get markers of their own


def assistant_spans(render: Render, messages: list[dict], prompt: str, closes_turns: bool) -> tuple[str, list]:
    """The conversation's rendering and, per assistant message, the `(start, end)` characters of
    what the model writes in it (the module docstring); `prompt` is the template's generation prompt
    and `closes_turns` whether it closes an assistant turn with text of its own."""
    whole = _Rendering.of(render, messages)
    spans = []
    done = 0  # where the previous turn's targets end
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            start = _turn_start(render, messages, whole, i, prompt, done)
            end = _turn_end(render, messages, whole, i, prompt, closes_turns, start)
            spans.append((start, max(start, end)))
            done = max(start, end)
    return whole.text, spans


def _turn_start(render: Render, messages: list[dict], whole: _Rendering, i: int, prompt: str, done: int) -> int:
    try:
        before = render(messages[:i], True)
    except ConversationError:
        if not prompt:
            raise
        before = prompt
    values = whole.values(i)
    found = _found_end(before, whole.text, done, values[0] if values else whole.next_value(i), last=True)
    if found is None:
        raise _unfound(i, "starts")
    return found[1]


def _turn_end(render: Render, messages: list[dict], whole: _Rendering, i: int, prompt: str, closes_turns: bool,
              start: int) -> int:
    text = whole.text
    if i == len(messages) - 1:
        return len(text.rstrip())
    upto = render(messages[:i + 1], True)
    if prompt and upto.endswith(prompt):
        upto = upto[:-len(prompt)]
    found = _found_end(upto, text, start, whole.next_value(i), last=False)
    values = whole.values(i)
    if found is None or (values is not None and found[0] > values[1]):
        raise _unfound(i, "ends")
    end = start + len(text[start:found[1]].rstrip())
    if not closes_turns:  # the next message's first character: generation stops on the token holding it
        end = min(len(text) - len(text[end:].lstrip()) + 1, len(text))
    return end


def _found_end(pattern: str, text: str, low: int, high: int, last: bool) -> tuple[int, int] | None:
    """Where in `text[low:high]` the longest end of `pattern` is found (the last place or the
    first), as `(start, end)`; None where not even its last character is."""
    def place(length: int) -> int:
        piece = pattern[len(pattern) - length:]
        return text.rfind(piece, low, high) if last else text.find(piece, low, high)

    # a piece found is found with every shorter end of it: the lengths found are 0 ... longest
    shortest, longest = 0, min(len(pattern), max(0, high - low))
    while shortest < longest:
        middle = (shortest + longest + 1) // 2
        if place(middle) >= 0:
            shortest = middle
        else:
            longest = middle - 1
    if shortest == 0:
        return None
    at = place(shortest)
    return at, at + shortest


def _unfound(i: int, what: str) -> ConversationError:
    return ConversationError(f"the chat template renders the conversation cut at assistant message {i} too unlike the "
                             f"whole to tell where that turn {what}; mark what the model writes in the template with "
                             "{% generation %} ... {% endgeneration %} blocks")


class _Rendering:
    """The conversation rendered without the generation prompt, and where each message's values are
    in the text (the module docstring's step 1): read off markers, or found by perturbing one message."""

    def __init__(self, render: Render, messages: list[dict], text: str, values: dict | None):
        self._render, self._messages, self.text = render, messages, text
        self._values: dict[int, tuple[int, int] | None] = values or {}

    @classmethod
    def of(cls, render: Render, messages: list[dict]) -> _Rendering:
        """Values read off markers where taking them out gives the plain rendering back."""
        plain = render(messages, False)
        if len(messages) <= _MAX_MARKED:
            text, values = _unmarked(render(_with_markers(messages), False), len(messages))
            if text == plain and values is not None:
                return cls(render, messages, plain, values)
        return cls(render, messages, plain, None)

    def values(self, j: int) -> tuple[int, int] | None:
        """Where message j's rendered values start and end; None where none is rendered."""
        if j not in self._values:
            changed = _perturbed(self._messages[j], OPEN, CLOSE, numbers=True)
            if changed == self._messages[j]:
                self._values[j] = None
            else:
                messages = list(self._messages)
                messages[j] = changed
                other = self._render(messages, False)
                self._values[j] = None if other == self.text else _difference(self.text, other)
        return self._values[j]

    def next_value(self, i: int) -> int:
        """Where the first rendered value of a message after message i starts (the text's end without one)."""
        for j in range(i + 1, len(self._messages)):
            if (values := self.values(j)) is not None:
                return values[0]
        return len(self.text)


def _with_markers(messages: list[dict]) -> list[dict]:
    return [_perturbed(m, chr(_MARKER_BASE + 2 * j), chr(_MARKER_BASE + 2 * j + 1), numbers=False)
            for j, m in enumerate(messages)]


def _unmarked(text: str, count: int) -> tuple[str, dict[int, tuple[int, int] | None] | None]:
    """The text without markers, and where each message's first and last marker are in it; None
    for the places where some message's markers do not come in opening-closing pairs (a template
    that cut a value: its ends would be wrong)."""
    values: dict[int, tuple[int, int] | None] = dict.fromkeys(range(count))
    opened: dict[int, bool] = {}
    for removed, match in enumerate(_MARKER.finditer(text)):
        code, at = ord(match.group()) - _MARKER_BASE, match.start() - removed
        j, closing = divmod(code, 2)
        if opened.get(j, False) != bool(closing):
            return _MARKER.sub("", text), None
        opened[j] = not closing
        values[j] = (values[j][0] if values[j] else at, at)
    return _MARKER.sub("", text), None if any(opened.values()) else values


def _perturbed(message: dict, opening: str, closing: str, numbers: bool) -> dict:
    """The message with its values wrapped in the two characters: its content and reasoning, a tool
    call's arguments (not its name, id or type, which templates check or repeat elsewhere)."""
    out = dict(message)
    for key in ("content", *REASONING_FIELDS):
        if key in out:
            out[key] = _wrapped(out[key], opening, closing, numbers)
    if out.get("tool_calls"):
        calls = copy.deepcopy(out["tool_calls"])
        for call in calls:
            holder = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(holder, dict) and "arguments" in holder:
                holder["arguments"] = _wrapped(holder["arguments"], opening, closing, numbers)
        out["tool_calls"] = calls
    return out


def _wrapped(value, opening: str, closing: str, numbers: bool):
    """`value` with its non-empty string leaves (and number leaves, with `numbers`) wrapped."""
    if isinstance(value, dict):
        return {k: _wrapped(v, opening, closing, numbers) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrapped(v, opening, closing, numbers) for v in value]
    if (isinstance(value, str) and value) or (numbers and isinstance(value, (int, float)) and not isinstance(value, bool)):
        return f"{opening}{value}{closing}"
    return value


def _difference(a: str, b: str) -> tuple[int, int]:
    """`(first, end)`: `a[first:end]` is where `a` differs from `b` (common prefix and suffix removed)."""
    limit = min(len(a), len(b))
    first = _common_prefix(a, b, limit)
    return first, len(a) - _common_prefix(a[::-1], b[::-1], limit - first)


def _common_prefix(a: str, b: str, limit: int) -> int:
    # binary search on slice equality: C-speed comparisons, log(n) of them
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
