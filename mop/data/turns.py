r"""Where the model writes in a chat template's rendering: each assistant turn's span of characters,
for templates that do not mark it themselves with `{% generation %}` blocks.

A turn's targets are all the model writes in it: its reasoning, content and tool calls from their
opening text (the names, ids and arguments it writes) through the template's end of the turn, the
token or text generation stops on (Qwen3's `<|im_end|>`; gpt-oss's `<|end|>`, `<|call|>` or
`<|return|>`; DeepSeek's `<｜end▁of▁sentence｜>`); not the role header before it, the separator
after it, nor any system, user or tool turn. All comes from renderings of the conversation, none
from which tokens a tokenizer flags special. Example, a ChatML template: R renders a conversation,
P the messages before its assistant turn and Q those through it, P and Q with the generation prompt:
R = <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n...
P = <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
Q = <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n
In R, P less its prompt ends where the turn's header starts, and the turn starts where the prompt's
text ends, at `Hello`; Q less its prompt ends after the turn's newline, which is left out. Targets:
`Hello<|im_end|>`, the tokens that hold it.

For assistant message i (what "found" and "pinned" mean: `_longest_end`):
1. values: each message's strings and numbers (`_perturbed`) are wrapped in marks of its own and
   the conversation rendered once: where taking them out gives R back and they pair up, they bound
   each message's values in R; else, and for an assistant turn without marks, where R and a
   rendering with that message's values perturbed differ (`_Rendering`);
2. start: P less its prompt is found ending between the previous turn's end and turn i's first
   value (the next message's, for a turn without one), pinned at the previous message's last value
   where that lies between; the turn starts after it and its header (`_header_length`). Where P's
   end is not in R or is found only where R repeats it before the turn, the turn starts where P
   stops agreeing with R (`_agreement`); where no P is found and nothing pins it (an opening turn of
   a template that needs a first message, which renders no P), after the first whole header;
3. end: Q less its prompt is found ending between the turn's start and the next value of a later
   message, pinned at the turn's last value (its start, for a turn without one); the turn ends
   there, trailing whitespace left out (where no such prefix renders, as Qwen3.5's template refuses
   one without a user turn, the prefix after a user turn of its own, whose end is the same). The
   last message ends where R does, less the text the template writes after the last message
   (`Headers.trailer`) and that whitespace;
4. where a template closes a turn with no text of its own (GLM-4.5 stops on the next message's
   `<|user|>` or `<|observation|>`, which its own fine-tuning code trains), each turn but the last
   extends through the first character after it, so the token holding that is a target.
P (where pinned) and Q are rendered from a short conversation first, then whole (`_prefixes`).
Invariant: P and Q agree with R right before a turn starts and ends, whatever they render otherwise
earlier; pins hold a match to its turn where other turns repeat its text. One marked rendering
would not do: templates are not prefix-stable (Qwen3 and gpt-oss drop earlier turns' reasoning;
gpt-oss ends the last turn with `<|return|>`, earlier ones with `<|end|>`), headers differ with
what precedes them (DeepSeek-V3.1 writes none after a tool result; Mistral's `[INST]` templates
have no generation prompt), and templates check or repeat a tool call's opening text, name and id,
so those cannot be marked. A start or end not found is a `ConversationError` saying to mark the
template's assistant text with `{% generation %}` blocks. Cost: two renderings of the conversation,
two short ones per assistant turn, and a whole one per assistant turn without marks (an empty turn,
a call without arguments) or after a message without (an empty tool result).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import NamedTuple

from mop.data.bisection import common_prefix, largest_holding
from mop.data.errors import ConversationError

Render = Callable[[list[dict], bool], str]
"""Renders messages with the conversation's tools, with or without the generation prompt."""


class Headers(NamedTuple):
    """A template's assistant headers: `prompt`, what `add_generation_prompt` adds after a user turn
    ("" for a template without one); `cuts`, where its tokens end in it (the tokenizer's offsets of
    the prompt alone), which a turn's start may fall on; `shown`, longest first, the part of the
    prompt each header the template writes before an earlier turn's text shows (`Headers.of`);
    `trailer`, what a rendering without the prompt ends with after the last message's turn, never a
    target (Phi-3.5's eos token; the prompt itself, for a template that writes it after every
    conversation)."""

    prompt: str
    cuts: tuple[int, ...]
    shown: tuple[str, ...]
    trailer: str = ""

    @classmethod
    def of(cls, prompt: str, cuts: Iterable[int], headers: Iterable[str], trailer: str = "") -> Headers:
        """From the prompt, its token ends and the headers earlier turns show: each header's part of the
        prompt is all of it where it lies inside (DeepSeek-R1's leaves out the think block the prompt
        opens; a prompt with text before the header ends with it), else the beginning of the prompt it
        repeats, to a token's end (a prompt that opens a think block which earlier turns render closed
        and empty: `<think></think>` after the prompt's `<think>`)."""
        cuts = tuple(sorted({*cuts, len(prompt)} - {0}))
        shown = set()
        for header in headers:
            repeated = common_prefix(prompt, header)
            part = header if header in prompt else prompt[:max((c for c in cuts if c <= repeated), default=0)]
            if part:
                shown.add(part)
        return cls(prompt, cuts, tuple(sorted(shown, key=len, reverse=True)), trailer)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters wrapped around perturbed values
_MARKER_BASE = 0xF0000  # message j's strings between chr(base + 4j) and chr(base + 4j + 1), numbers + 2 and + 3
_MARKER = re.compile("[\U000F0000-\U000FFFFD]")
_QUOTED_MARK = re.compile('"([\U000F0000-\U000FFFFD])([^"\U000F0000-\U000FFFFD]*)([\U000F0000-\U000FFFFD])"')
_MAX_MARKED = (0xFFFFD - _MARKER_BASE) // 4  # messages that get markers of their own
_KEPT = 4  # messages before a cut that a short prefix rendering keeps (back to an assistant turn)
_OPENER = {"role": "user", "content": "mop opener"}  # before a prefix a template renders only after a user turn


def assistant_spans(render: Render, messages: list[dict], headers: Headers, closes_turns: bool) -> tuple[str, list]:
    """The conversation's rendering and the `(start, end)` characters of what the model writes in
    its assistant turns, in order, turns that write nothing left out (the module docstring);
    `closes_turns`: whether the template ends a turn with text of its own."""
    whole = _Rendering.of(render, messages)
    spans = []
    start = done = 0  # where the previous turn's own text starts and ends
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            start = _turn_start(render, messages, whole, i, headers, (start, done))
            done = max(start, _turn_end(render, messages, whole, i, headers, start))
            stop = done
            if not closes_turns and i < len(messages) - 1:  # step 4: through the next message's first character
                stop = min(len(whole.text) - len(whole.text[done:].lstrip()) + 1, len(whole.text))
            if stop > start:
                spans.append((start, stop))
    return whole.text, spans


def _prefixes(render: Render, messages: list[dict], upto: int, short: bool = True) -> Iterator[str]:
    """Renderings of `messages[:upto]` with the generation prompt: with `short`, first the messages up
    to the first user turn and those from an assistant turn `_KEPT` or more before the end (what they
    leave out changes what is rendered before the last ones, which is all a match uses; from an
    assistant turn keeps a template's alternation and a tool result's call), then all of them; one
    that cannot be rendered left out."""
    head = next((j + 1 for j, m in enumerate(messages[:upto]) if m.get("role") == "user"), 0)
    cut = upto - _KEPT
    while cut > head and messages[cut].get("role") != "assistant":
        cut -= 1
    for part in ([messages[:head] + messages[cut:upto]] if short and cut > head else []) + [messages[:upto]]:
        try:
            yield render(part, True)
        except ConversationError:
            continue


def _turn_start(render: Render, messages: list[dict], whole: _Rendering, i: int, headers: Headers,
                last: tuple[int, int]) -> int:
    """Step 2: where a rendering of the messages before turn i, less its generation prompt, is found,
    then the header that follows it; `last`: where the previous turn's own text starts and ends."""
    begun, done = last
    span = whole.value_span(i)
    high = span[0] if span is not None else whole.next_value_start(i, done)
    previous = whole.value_span(i - 1)[1] if i and whole.value_span(i - 1) is not None else -1
    pinned = done <= previous <= high  # the match must span the previous message's text, where it lies between
    # a short rendering only where the match is pinned: one that ends otherwise than the whole prefix (a
    # template that numbers its messages) is found by a shorter end, at a place only a pin can refuse
    before = ""
    for before in _prefixes(render, messages, i, short=pinned):
        prompted = bool(headers.prompt) and before.endswith(headers.prompt)
        context = before[:len(before) - len(headers.prompt)] if prompted else before
        if not context:  # nothing before the turn but its header: it opens the conversation
            break
        found = _longest_end(context, whole.text, done, high, previous if pinned else None)
        if found is not None and not pinned and whole.text.find(whole.text[found[0]:found[1]], found[0] + 1, high) >= 0:
            # the end found recurs before the turn's text: where the prefix stops agreeing after the last turn
            if agreed := _agreement(before, whole.text, begun, done, high):
                return done + agreed
        if found is not None:
            return found[1] + (_header_length(whole.text, found[1], headers, high) if prompted else 0)
    if pinned and (agreed := _agreement(before, whole.text, done, previous, high)):
        return previous + agreed
    for at in range(done, high) if not pinned else ():  # an opening turn: after the first header
        if length := _header_length(whole.text, at, headers, high, whole=True):
            return at + length
    raise _unfound(i, "starts")


def _agreement(before: str, text: str, low: int, anchor: int, high: int) -> int:
    """How far past `anchor` a prefix rendering whose end the whole does not show agrees with it: the
    whole's `text[low:anchor]` found last in `before`, then the characters both go on with alike,
    before `high` (0 where it is not found). A prefix ends so where DeepSeek-R1 writes a second
    tool-calling message straight after the tool outputs, which the prefix closes: text the whole
    never shows."""
    at = before.rfind(text[low:anchor])
    if at < 0:
        return 0
    return common_prefix(before[at + anchor - low:], text[anchor:high])


def _header_length(text: str, at: int, headers: Headers, high: int, whole: bool = False) -> int:
    """How much of a turn's header `text` holds at `at`, before `high` (the turn's first value): the
    part of the generation prompt it repeats from there, to the end of a prompt token (a prompt that
    opens a think block earlier turns render closed and empty, `<think></think>` after the prompt's
    `<think>`, or leave out: DeepSeek-R1's), or a shown header, whichever is longer. With `whole`,
    only the whole prompt or a shown header (what tells a turn's start where nothing pins it)."""
    ahead = text[at:min(high, at + len(headers.prompt))]
    repeated = common_prefix(headers.prompt, ahead)
    cut = max((c for c in headers.cuts if c <= repeated and (not whole or c == len(headers.prompt))), default=0)
    shown = next((len(h) for h in headers.shown if text.startswith(h, at, high)), 0)
    return max(cut, shown)


def _turn_end(render: Render, messages: list[dict], whole: _Rendering, i: int, headers: Headers, start: int) -> int:
    """Step 3: where a rendering of the messages through turn i, less the next generation prompt, is
    found."""
    text, prompt = whole.text, headers.prompt
    if i == len(messages) - 1:
        if headers.trailer and text.endswith(headers.trailer):
            text = text[:-len(headers.trailer)]
        return len(text.rstrip())
    span = whole.value_span(i)
    spanned = span[1] if span is not None else start  # what the match must span: the turn's last text, or its start
    for after in chain(_prefixes(render, messages, i + 1), _prefixes(render, [_OPENER, *messages[:i + 1]], i + 2)):
        if prompt and after.endswith(prompt):
            after = after[:-len(prompt)]
        found = _longest_end(after, text, start, whole.next_value_start(i, start), spanned)
        if found is not None:
            return start + len(text[start:found[1]].rstrip())
    raise _unfound(i, "ends")


def _longest_end(pattern: str, text: str, low: int, high: int, pin: int | None = None) -> tuple[int, int] | None:
    """The longest end of `pattern` found in `text` ending between `low` and `high`, at its first such
    place, as `(start, end)` in `text`; with `pin`, only the ends found spanning it (from before it to
    at or after it: the match holds the last character of the value that ends there). None where
    there is none."""
    if pin is None:
        def place(length: int) -> int:
            return text.find(pattern[len(pattern) - length:], max(0, low - length), high)

        # an end found is found with every shorter end of it (ending at the same place): a binary search
        length = largest_holding(min(len(pattern), high), lambda n: place(n) >= 0)
        return (place(length), place(length) + length) if length else None
    # a match spanning the pin ends at an `end` where `text[pin - 1:end]` ends the pattern: few places
    best = None
    for end in range(max(low, pin), min(high, pin - 1 + len(pattern)) + 1):
        if pattern.endswith(text[pin - 1:end]):
            length = largest_holding(min(len(pattern), end), lambda n: text[end - n:end] == pattern[len(pattern) - n:])
            if best is None or length > best[1] - best[0]:
                best = (end - length, end)
    return best


def _unfound(i: int, what: str) -> ConversationError:
    return ConversationError(f"the chat template renders the conversation cut at assistant message {i} too unlike the "
                             f"whole to tell where that turn {what}; mark what the model writes in the template with "
                             "{% generation %} ... {% endgeneration %} blocks")


class _Rendering:
    """The conversation rendered without the generation prompt, and where each message's values are
    in the text (the module docstring's step 1): read off markers, or found by perturbing one message
    (every message, where the markers fail; an assistant turn the markers did not place, where they work)."""

    def __init__(self, render: Render, messages: list[dict], text: str, values: dict | None):
        self._render, self._messages, self.text = render, messages, text
        self._marked = values is not None
        self._values: dict[int, tuple[int, int] | None] = values or {}

    @classmethod
    def of(cls, render: Render, messages: list[dict]) -> _Rendering:
        plain = render(messages, False)
        values = None
        if len(messages) <= _MAX_MARKED:
            try:
                text, marked = _unmarked(render(_with_markers(messages), False), len(messages))
            except ConversationError:  # a template that checks a value the markers change
                text, marked = None, None
            if text == plain and marked is not None:
                values = marked
        return cls(render, messages, plain, values)

    def value_span(self, j: int) -> tuple[int, int] | None:
        """Where message j's rendered values start and end; None where none is rendered. Where the
        markers worked, a message without marks is perturbed only if it is an assistant turn, which
        needs a place; another (an empty tool result) has none, and costs no rendering."""
        if j not in self._values and (not self._marked or self._messages[j].get("role") == "assistant"):
            # blank strings too: a turn of no arguments and blank content still has a place
            changed = _perturbed(self._messages[j], (OPEN, CLOSE, OPEN, CLOSE), empty=True)
            messages = list(self._messages)
            messages[j] = changed
            try:
                other = self._render(messages, False) if changed != self._messages[j] else self.text
            except ConversationError:  # a template that refuses the perturbed message (gpt-oss: content and thinking)
                other = self.text
            self._values[j] = None if other == self.text else _difference(self.text, other)
        return self._values.get(j)

    def next_value_start(self, i: int, after: int) -> int:
        """Where the first rendered value of a message after message i starts, of those starting after
        `after` (the text's end without one). A perturbed message that moves text elsewhere (Mistral's
        tools go before the last user turn, and before any equal to it) seems to start before."""
        for j in range(i + 1, len(self._messages)):
            if (span := self.value_span(j)) is not None and span[0] > after:
                return span[0]
        return len(self.text)


def _with_markers(messages: list[dict]) -> list[dict]:
    return [_perturbed(m, tuple(chr(_MARKER_BASE + 4 * j + k) for k in range(4)), empty=False)
            for j, m in enumerate(messages)]


def _unmarked(text: str, count: int) -> tuple[str, dict[int, tuple[int, int]] | None]:
    """The text without markers (and without the quotes JSON put around a marked number), and where
    the first and last marker of each message that has any are in it; None where some message's
    markers do not come in opening-closing pairs (a template that cut a value: its ends would be
    wrong)."""
    def unquoted(match: re.Match) -> str:
        opening, closing = (ord(match.group(k)) - _MARKER_BASE for k in (1, 3))
        return match.group()[1:-1] if opening % 4 == 2 and closing == opening + 1 else match.group()

    text = _QUOTED_MARK.sub(unquoted, text)
    values: dict[int, tuple[int, int]] = {}
    opened: dict[int, int] = {}  # message -> the kind of its open marker
    for removed, match in enumerate(_MARKER.finditer(text)):
        code, at = ord(match.group()) - _MARKER_BASE, match.start() - removed
        j, kind = divmod(code, 4)
        closing = kind % 2
        if j >= count or (j in opened) != bool(closing) or (closing and opened[j] != kind - 1):
            return text, None
        if closing:
            del opened[j]
        else:
            opened[j] = kind
        values[j] = (values[j][0] if j in values else at, at)
    return _MARKER.sub("", text), None if opened else values


def _perturbed(message: dict, marks: tuple[str, ...], empty: bool) -> dict:
    """The message with its values wrapped in `marks` (`_wrapped`): its content and reasoning, a tool
    call's arguments (not its name, id or type, which templates check or repeat elsewhere)."""
    out = dict(message)
    for key in ("content", *REASONING_FIELDS):
        if key in out:
            out[key] = _wrapped(out[key], marks, empty)
    if out.get("tool_calls"):
        calls = copy.deepcopy(out["tool_calls"])
        for call in calls:
            holder = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(holder, dict) and "arguments" in holder:
                holder["arguments"] = _wrapped(holder["arguments"], marks, empty)
        out["tool_calls"] = calls
    return out


def _wrapped(value, marks: tuple[str, ...], empty: bool):
    """`value` with its leaves wrapped: a string between `marks[0]` and `marks[1]` inside its
    surrounding whitespace and after a reasoning block it holds (which templates strip or cut off), a
    number as a string between `marks[2]` and `marks[3]` (JSON quotes it; `_unmarked` takes those
    quotes out), a blank string only with `empty` (it would no longer test false or strip to nothing).
    A "type" entry (of a content part) is left as it is."""
    if isinstance(value, dict):
        return {k: v if k == "type" else _wrapped(v, marks, empty) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrapped(v, marks, empty) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{marks[2]}{value}{marks[3]}"
    if isinstance(value, str) and (value.strip() or empty):
        head = value.rfind("</think>") + len("</think>") if "</think>" in value else 0  # what templates keep of it
        core = value[head:].strip() or value[head:]
        head = value.index(core, head)
        return f"{value[:head]}{marks[0]}{core}{marks[1]}{value[head + len(core):]}"
    return value


def _difference(a: str, b: str) -> tuple[int, int]:
    """`(first, end)`: `a[first:end]` is where `a` differs from `b` (common prefix and suffix removed)."""
    limit = min(len(a), len(b))
    first = common_prefix(a, b, limit)
    return first, len(a) - common_prefix(a[::-1], b[::-1], limit - first)
