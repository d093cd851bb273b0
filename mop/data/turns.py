"""Where the model writes in a chat template's rendering: each assistant turn's span of characters,
for templates that do not mark it themselves with `{% generation %}` blocks.

A turn's targets are everything the model writes in it: its reasoning, content and tool calls from
their opening text (the names, ids and arguments it writes) through the template's own end of the
turn, the token or text generation stops on (Qwen3's `<|im_end|>`, gpt-oss's `<|end|>`, `<|call|>`
or `<|return|>`, DeepSeek's `<｜end▁of▁sentence｜>`). Not the role header before it, the separator
after it (Qwen3's newline after `<|im_end|>`), nor any system, user or tool turn. Which tokens a
tokenizer flags special plays no part: everything comes from renderings of the conversation.

For assistant message i of a conversation rendered as R ("found" below: the longest end of a text
that R holds ending within a range, at the first such place, by a binary search of `str.find`):
1. values: every message's strings (content, reasoning, tool-call argument strings, tool results)
   are wrapped in private-use characters of its own and the conversation rendered once; where taking
   them out gives R back and every message's marks pair up, a message's first and last marks bound
   its values in R. Otherwise (a template that cuts or reformats a value, as Qwen3 splits a `<think>`
   block off the content), and for a message without marked strings, they are where R and a
   rendering with that message's strings, empty ones too, and numbers perturbed differ;
2. start: the model starts writing turn i where the rendering of `messages[:i]` with the generation
   prompt, P, ends. P less that prompt is found ending between the previous turn's end and turn i's
   first value (the next message's, for a turn without one), spanning the last value before the turn
   when it lies there; the turn starts after it and as much of the prompt as R continues with (a
   prompt that opens a think block earlier turns do not show, as DeepSeek-R1's, is only partly
   there). When P cannot be rendered (a template that needs a first message), the turn opens the
   conversation: it starts after the prompt's first place in R;
3. end: the rendering of `messages[:i + 1]` with the generation prompt, Q, shows the turn followed by
   nothing but the next turn's prompt. Q less that prompt is found ending between the turn's start and
   the next value of a later message, spanning the turn's last value in R (its start, for a turn
   without one); the turn ends there, trailing whitespace left out (Qwen3's newline after
   `<|im_end|>`). The conversation's last message ends where R does, trailing whitespace left out;
4. a template that closes an assistant turn with no text of its own (GLM-4.5, whose generation
   stops on the next message's `<|user|>` or `<|observation|>`, the token its own fine-tuning code
   trains) has each turn but the conversation's last extended through the first character of what
   follows it, so the token holding it is a target.
Why prefix renderings, matched by their ends, and not one rendering with markers alone: templates are
not prefix-stable (Qwen3 and gpt-oss drop earlier turns' reasoning, gpt-oss ends the last turn with
`<|return|>` and earlier ones with `<|end|>`), a turn's header differs with what precedes it
(DeepSeek-V3.1 writes none after a tool result; Mistral's `[INST]` templates have no generation
prompt), and a tool call's opening text, name and id are written by the model but checked or
repeated by templates, so they cannot be marked. P and Q agree with R right before a turn starts and
right before it ends, whatever they render differently earlier; that a match spans a value pins it to
its turn when later turns repeat the same text. A turn whose start or end is not found so is a
`ConversationError` saying to mark the template's assistant text with `{% generation %}` blocks.
Cost: two renderings of the conversation and two of its prefix up to each assistant turn, plus one
per message the markers do not place: quadratic in the number of turns.
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
    """The conversation's rendering and the `(start, end)` characters of what the model writes in
    its assistant turns, in order, turns that write nothing left out (the module docstring); `prompt`
    is the template's generation prompt and `closes_turns` whether it ends a turn with text of its own."""
    whole = _Rendering.of(render, messages)
    spans = []
    done = 0  # where the previous turn's own text ends
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            start = _turn_start(render, messages, whole, i, prompt, done)
            done = max(start, _turn_end(render, messages, whole, i, prompt, start))
            stop = done
            if not closes_turns and i < len(messages) - 1:  # step 4: through the next message's first character
                stop = min(len(whole.text) - len(whole.text[done:].lstrip()) + 1, len(whole.text))
            if stop > start:
                spans.append((start, stop))
    return whole.text, spans


def _turn_start(render: Render, messages: list[dict], whole: _Rendering, i: int, prompt: str, done: int) -> int:
    """Step 2: where the rendering of `messages[:i]` before its generation prompt is found, then as
    much of the prompt as follows it."""
    try:
        before = render(messages[:i], True)
    except ConversationError:
        if not prompt:
            raise
        before = prompt
    header = prompt if prompt and before.endswith(prompt) else ""
    context = before[:len(before) - len(header)]
    values = whole.values(i)
    high = values[0] if values is not None else whole.next_value(i, done)
    if not context:  # nothing before the turn but its header: it opens the conversation
        at = whole.text.find(header, done, high) if header else -1
        if at < 0:
            raise _unfound(i, "starts")
        return at + len(header)
    found = _longest_end(context, whole.text, done, high)
    previous = whole.last_value(i - 1, high)
    if found is None or (previous is not None and previous >= done and not found[0] <= previous <= found[1]):
        raise _unfound(i, "starts")  # the match must span the last text before the turn: it pins the place
    at = found[1]
    return at + _common_prefix(whole.text[at:at + len(header)], header, len(header))


def _turn_end(render: Render, messages: list[dict], whole: _Rendering, i: int, prompt: str, start: int) -> int:
    """Step 3: where the rendering of `messages[:i + 1]` up to the next generation prompt is found."""
    text = whole.text
    if i == len(messages) - 1:
        return len(text.rstrip())
    after = render(messages[:i + 1], True)
    if prompt and after.endswith(prompt):
        after = after[:-len(prompt)]
    found = _longest_end(after, text, start, whole.next_value(i, start))
    values = whole.values(i)
    pinned = values[1] if values is not None else start  # what the match must span: the turn's last text, or its start
    if found is None or not found[0] <= pinned <= found[1]:
        raise _unfound(i, "ends")
    return start + len(text[start:found[1]].rstrip())


def _longest_end(pattern: str, text: str, low: int, high: int) -> tuple[int, int] | None:
    """The longest end of `pattern` found in `text` ending between `low` and `high`, at its first
    such place, as `(start, end)` in `text`; None where not even its last character is."""
    def place(length: int) -> int:
        return text.find(pattern[len(pattern) - length:], max(0, low - length), high)

    # an end found is found with every shorter end of it (ending at the same place): binary search
    shortest, longest = 0, min(len(pattern), high)
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
    in the text (the module docstring's step 1): read off markers, or found by perturbing one message
    (every message, where the markers fail; a message the markers did not place, where they work)."""

    def __init__(self, render: Render, messages: list[dict], text: str, values: dict):
        self._render, self._messages, self.text = render, messages, text
        self._values: dict[int, tuple[int, int] | None] = values

    @classmethod
    def of(cls, render: Render, messages: list[dict]) -> _Rendering:
        plain = render(messages, False)
        values = {}
        if len(messages) <= _MAX_MARKED:
            try:
                text, marked = _unmarked(render(_with_markers(messages), False), len(messages))
            except ConversationError:  # a template that checks a value the markers change
                text, marked = None, None
            if text == plain and marked is not None:
                values = marked
        return cls(render, messages, plain, values)

    def values(self, j: int) -> tuple[int, int] | None:
        """Where message j's rendered values start and end; None where none is rendered."""
        if j not in self._values:
            # numbers and empty strings too: a turn of numeric arguments or an empty result still has a place
            changed = _perturbed(self._messages[j], OPEN, CLOSE, every_leaf=True)
            messages = list(self._messages)
            messages[j] = changed
            try:
                other = self._render(messages, False) if changed != self._messages[j] else self.text
            except ConversationError:  # a template that refuses the perturbed message (gpt-oss: content and thinking)
                other = self.text
            self._values[j] = None if other == self.text else _difference(self.text, other)
        return self._values[j]

    def next_value(self, i: int, after: int) -> int:
        """Where the first rendered value of a message after message i starts, of those starting after
        `after` (the text's end without one). A perturbed message that moves text elsewhere (Mistral's
        tools go before the last user turn, and before any equal to it) seems to start before."""
        for j in range(i + 1, len(self._messages)):
            if (values := self.values(j)) is not None and values[0] > after:
                return values[0]
        return len(self.text)

    def last_value(self, i: int, before: int) -> int | None:
        """Where the last rendered value of message i or an earlier one ends, of those ending by
        `before` (None without one)."""
        for j in range(i, -1, -1):
            if (values := self.values(j)) is not None and values[1] <= before:
                return values[1]
        return None


def _with_markers(messages: list[dict]) -> list[dict]:
    return [_perturbed(m, chr(_MARKER_BASE + 2 * j), chr(_MARKER_BASE + 2 * j + 1), every_leaf=False)
            for j, m in enumerate(messages)]


def _unmarked(text: str, count: int) -> tuple[str, dict[int, tuple[int, int]] | None]:
    """The text without markers, and where the first and last marker of each message that has any
    are in it; None where some message's markers do not come in opening-closing pairs (a template
    that cut a value: its ends would be wrong)."""
    values: dict[int, tuple[int, int]] = {}
    opened: dict[int, bool] = {}
    for removed, match in enumerate(_MARKER.finditer(text)):
        code, at = ord(match.group()) - _MARKER_BASE, match.start() - removed
        j, closing = divmod(code, 2)
        if j >= count or opened.get(j, False) != bool(closing):
            return _MARKER.sub("", text), None
        opened[j] = not closing
        values[j] = (values[j][0] if j in values else at, at)
    return _MARKER.sub("", text), None if any(opened.values()) else values


def _perturbed(message: dict, opening: str, closing: str, every_leaf: bool) -> dict:
    """The message with its values wrapped in the two characters: its content and reasoning, a tool
    call's arguments (not its name, id or type, which templates check or repeat elsewhere)."""
    out = dict(message)
    for key in ("content", *REASONING_FIELDS):
        if key in out:
            out[key] = _wrapped(out[key], opening, closing, every_leaf)
    if out.get("tool_calls"):
        calls = copy.deepcopy(out["tool_calls"])
        for call in calls:
            holder = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(holder, dict) and "arguments" in holder:
                holder["arguments"] = _wrapped(holder["arguments"], opening, closing, every_leaf)
        out["tool_calls"] = calls
    return out


def _wrapped(value, opening: str, closing: str, every_leaf: bool):
    """`value` with its non-empty string leaves wrapped, and with `every_leaf` its empty strings and
    numbers too (markers on those would change what the template renders: `""` tests false, a number
    becomes a quoted string in JSON). A "type" entry (of a content part) is left as it is."""
    if isinstance(value, dict):
        return {k: v if k == "type" else _wrapped(v, opening, closing, every_leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrapped(v, opening, closing, every_leaf) for v in value]
    if isinstance(value, str) and (value or every_leaf) or (
            every_leaf and isinstance(value, (int, float)) and not isinstance(value, bool)):
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
