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

Assistant targets (the loss's): what the model writes in each assistant turn, as characters of the
rendering. A template with `{% generation %}` blocks (transformers' tag) marks them itself: each
block's text is a target. Any other template's turns are found from renderings of the conversation
and of its prefixes (`mop.data.turns`), never from which tokens the tokenizer flags special. A token
is a target when its characters overlap a target span (the offsets transformers' assistant mask
reads), so the targets equal `apply_chat_template(..., return_assistant_tokens_mask=True)`'s mask
for a copy of the template with `{% generation %}` around what the model writes.

Probes when a template is loaded (a user turn, then two turns, without and with reasoning; with a
system prompt first where the template needs one): its assistant header (`mop.data.turns.Headers`:
what `add_generation_prompt` adds after a user turn, where its tokens end, what the template
writes before earlier answers, and what it writes after the last message without the prompt: an eos
token, or the prompt itself where it writes that after every conversation) and whether it closes an
assistant turn with text of its own (GLM-4.5's does not: the next message's first token is then the
turn's last target). A template that renders nothing between an assistant turn and the next user
turn is refused: its turns have no boundary.

The targets kept are always the assistant's: `data.loss_on = "all"` is applied when sequences are
built (`mop.data.chat.packing`), so one encoding serves both, and the assistant turns' ends are the
turn boundaries that `data.overlong = "truncate"` cuts at either way. Every problem with a
conversation is a `ConversationError` naming its row, which the readers turn into a one-line
`DataError` (or count and skip with `data.skip_invalid`). `TARGETS_VERSION` numbers this
definition of the targets; prepared folders record it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mop.data.bisection import common_prefix
from mop.data.errors import ConversationError, DataError
from mop.data.turns import REASONING_FIELDS, Headers, assistant_spans

TARGETS_VERSION = 4
"""1: targets from marked values to the next special token (mop before issue 36); 2: `mop.data.turns`;
3: a turn starts after the part of the generation prompt it repeats (issue 45); 4: text a template
writes after the last message is never a target, and a prompt it writes after every conversation is
found (issue 64)."""
TARGETS_CHANGES = {2: "tool calls from their opening text, turns found without special tokens",
                   3: "no token of a generation prompt that opens a think block is trained",
                   4: "no text a template writes after the last turn's end (an eos token, the next header) is "
                      "trained"}
"""What each version of the targets changed, for a refused prepared folder's message."""
_RECORDING = "_mop_recording"  # the render variable holding a `_Recording`, if any
_PROBE = [{"role": "user", "content": "mop probe one"}, {"role": "assistant", "content": "mop answer one"},
          {"role": "user", "content": "mop probe two"}, {"role": "assistant", "content": "mop answer two"}]
_SYSTEM_PROBE = {"role": "system", "content": "mop probe system"}
_PROBE_REASONING = "mop probe reasoning"


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


class _Recording:
    """The output length so far of a template being rendered, and its `{% generation %}` spans."""

    def __init__(self):
        self.length = 0
        self.spans: list[tuple[int, int]] = []


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' `{% generation %} ... {% endgeneration %}`: rendered as its body; while the
    template is rendered with a `_Recording`, the body's span in the output is appended to it (the
    output's length when the block is reached, as transformers measures it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_record", [jinja2.nodes.ContextReference()])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _record(self, context, caller):
        text = caller()
        recording = context.get(_RECORDING)
        if recording is not None:
            recording.spans.append((recording.length, recording.length + len(text)))
        return text


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (the module docstring)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env.from_string(source)


def _marks_generation(template: jinja2.Template, source: str, origin: str) -> bool:
    """Whether the template has `{% generation %}` blocks; refused where one sits in a macro, a
    `{% set %}`, `{% filter %}` or `{% call %}` block, whose output Jinja buffers: its place in the
    output could not be told (transformers would mark the wrong text)."""
    def blocks(node, buffered: bool):
        for child in node.iter_child_nodes():
            if isinstance(child, jinja2.nodes.CallBlock) and isinstance(child.call, jinja2.nodes.Call) and \
                    isinstance(child.call.node, jinja2.nodes.ExtensionAttribute) and child.call.node.name == "_record":
                yield buffered
                yield from blocks(child, True)
            else:
                inside = isinstance(child, (jinja2.nodes.Macro, jinja2.nodes.AssignBlock, jinja2.nodes.FilterBlock,
                                            jinja2.nodes.CallBlock))
                yield from blocks(child, buffered or inside)

    found = list(blocks(template.environment.parse(source), False))
    if any(found):
        raise DataError(f"data.chat_template: {origin} has a {{% generation %}} block inside a macro or a set, filter "
                        "or call block (or another generation block), whose place in the output cannot be told; move "
                        "it into the message loop")
    return bool(found)


def read_template(tokenizer_dir: Path | None, override: str = "") -> tuple[str, str]:
    """The chat template's text and where it came from: the file `override`, else the tokenizer
    folder's (`folder_template`)."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template: {path} is not a file; point it at a Jinja chat template")
        return path.read_text(encoding="utf-8"), str(path)
    if tokenizer_dir is None:
        raise DataError("data.format = 'chat' needs a chat template: set data.tokenizer to a Hugging Face tokenizer "
                        "folder with one, or data.chat_template to a template file")
    found = folder_template(tokenizer_dir)
    if found is None:
        raise DataError(f"data.tokenizer: {tokenizer_dir} has no chat template (no chat_template.jinja, no "
                        "chat_template in tokenizer_config.json); set data.chat_template to a template file")
    return found


def folder_template(tokenizer_dir: Path) -> tuple[str, str] | None:
    """A tokenizer folder's chat template and its file: `chat_template.jinja`, else the `chat_template`
    of `tokenizer_config.json` (a string, or the entry named "default" of a list); None without one."""
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default")
        template = next(named, None)
    return (template, str(config_file)) if isinstance(template, str) and template else None


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


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token's `[start, end)` characters overlap one of the sorted, disjoint spans (an
    empty span marks a token that holds its place inside it: transformers' rule)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if not len(spans):
        return np.zeros(len(offsets), dtype=bool)
    k = np.searchsorted(spans[:, 1], offsets[:, 0], side="right")  # the first span ending after the token starts
    return (k < len(spans)) & (offsets[:, 1] > spans[np.minimum(k, len(spans) - 1), 0])


class ChatTemplate:
    """A tokenizer and its chat template: `encode(conversation) -> (ids, assistant targets)` (the
    module docstring)."""

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
        self.marks_generation = _marks_generation(self._template, source, origin)
        # what finding the turns needs (mop.data.turns); a template with generation blocks marks them itself
        self._headers = Headers("", (), ()) if self.marks_generation else self._probe_headers()
        self._closes_turns = self.marks_generation or self._probe_turn_ends()

    def summary(self) -> str:
        """One line on how the targets are found: the template's own generation blocks, or the header
        and trailer its probes found (`mop data inspect` prints it)."""
        if self.marks_generation:
            return f"chat template {self.origin}: targets from its {{% generation %}} blocks"
        prompt, trailer = self._headers.prompt, self._headers.trailer
        found = f"generation prompt {prompt!r}" if prompt else "no generation prompt"
        if trailer and trailer == prompt:
            found += ", written after every conversation (not trained after the last message)"
        elif trailer:
            found += f"; {trailer!r} written after the last message without it (not trained)"
        return f"chat template {self.origin}: {found}"

    def render(self, conversation: Conversation, add_generation_prompt: bool = False, messages=None,
               recording: _Recording | None = None) -> str:
        messages = conversation.messages if messages is None else messages
        variables = dict(messages=messages, tools=conversation.tools, documents=None,
                         add_generation_prompt=add_generation_prompt, **self._special_tokens)
        try:
            if recording is None:
                return self._template.render(**variables)
            parts = []
            for part in self._template.generate(**variables, **{_RECORDING: recording}):
                parts.append(part)
                recording.length += len(part)
            return "".join(parts)
        except jinja2.exceptions.TemplateError as e:
            raise ConversationError(f"the chat template {self.origin} fails to render it ({e})") from None
        except (TypeError, AttributeError, LookupError, ValueError, ArithmeticError) as e:
            raise ConversationError(f"the chat template {self.origin} fails to render it "
                                    f"({type(e).__name__}: {e})") from None

    def spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the character spans of its assistant targets, in order."""
        conversation = Conversation(_prepared_messages(conversation.messages), conversation.tools)
        if not any(m.get("role") == "assistant" for m in conversation.messages):
            raise ConversationError("it has no assistant turn")
        if self.marks_generation:
            recording = _Recording()
            text = self.render(conversation, recording=recording)
            return text, sorted(recording.spans)  # blocks are never nested (`_marks_generation`): disjoint
        return assistant_spans(lambda messages, prompt: self.render(conversation, prompt, messages),
                               conversation.messages, self._headers, self._closes_turns)

    def encode(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and the assistant targets (bool) of one conversation."""
        text, spans = self.spans(conversation)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return ids, _overlapping(offsets, spans)

    def encode_prompt(self, conversation: Conversation) -> np.ndarray:
        """Token ids (int64) of a conversation rendered with the generation prompt, as a model is given
        it to answer (TRL's `prompt_ids` of a preference pair)."""
        prepared = Conversation(_prepared_messages(conversation.messages), conversation.tools)
        return self.tokenizer.encode_with_offsets(self.render(prepared, add_generation_prompt=True))[0]

    def _probe(self, messages: list[dict], add_generation_prompt: bool) -> str | None:
        """A probe conversation rendered, with a system prompt before it where the template needs one
        (None where neither renders)."""
        for probe in (messages, [_SYSTEM_PROBE, *messages]):
            try:
                return self.render(Conversation(probe), add_generation_prompt)
            except ConversationError:
                continue
        return None

    def _probe_headers(self) -> Headers:
        """The generation prompt and trailer (`_prompt_and_trailer`; "" where no probe renders), and the
        headers the template writes before earlier turns' text: each answer of the two-turn probe,
        without and with reasoning (before and after the last user turn, with the think block a
        template renders or drops)."""
        plain, prompted = self._probe(_PROBE[:1], False), self._probe(_PROBE[:1], True)
        if plain is None or prompted is None:
            return Headers("", (), ())
        prompt, trailer = self._prompt_and_trailer(plain, prompted)
        if not prompt:
            return Headers("", (), (), trailer)
        shown = []
        for probe in (_PROBE, [dict(m, reasoning_content=_PROBE_REASONING) if m["role"] == "assistant" else m
                               for m in _PROBE]):
            text = self._probe(probe, False)
            for answer in (1, 3):
                before = self._probe(probe[:answer], False)
                if before is not None and trailer and before.endswith(trailer):
                    before = before[:-len(trailer)]
                if before is None or text is None or not text.startswith(before):
                    continue
                rest = text[len(before):]
                found = [at for at in (rest.find(_PROBE_REASONING), rest.find(probe[answer]["content"])) if at >= 0]
                if found:
                    shown.append(rest[:min(found)])
        return Headers.of(prompt, self._token_ends(prompt), shown, trailer)

    def _prompt_and_trailer(self, plain: str, prompted: str) -> tuple[str, str]:
        """What `add_generation_prompt` adds after a user turn, and what the template writes after the
        last message's turn without it (the trailer), from the one-turn probe rendered without and
        with the prompt: the rest of the prompted rendering where it starts with the plain one (most
        templates: no trailer); else both ends past the last token end the two agree to (a template
        that appends the eos token unless the prompt is asked, Phi-3.5's); where the prompt changes
        nothing, the text the template writes after every conversation (`_written_after_all`), or
        none ("", "": a template without a generation prompt, Mistral's)."""
        if prompted.startswith(plain) and prompted != plain:
            return prompted[len(plain):], ""
        if prompted != plain:
            agreed = common_prefix(plain, prompted)
            cut = max((int(end) for end in set(self._token_ends(plain)) & set(self._token_ends(prompted))
                       if end <= agreed), default=0)
            two_turns = self._probe(_PROBE[:2], False)
            if two_turns is None or not two_turns.endswith(plain[cut:]):  # not written after every conversation
                return "", ""
            return prompted[cut:], plain[cut:]
        trailer = self._written_after_all(plain)
        return trailer, trailer

    def _written_after_all(self, plain: str) -> str:
        """The text a template writes after every conversation, with or without the generation prompt
        (the next assistant header and an opening `<think>\\n`): what the two-turn probe writes after
        its answer, from where the next header starts. That header starts where the text after the
        answer and after it in the three-turn probe (a user turn next) part, at the next role, less
        the part of a header before its role (ChatML's `<|im_start|>`, Llama's `<|start_header_id|>`):
        the text the one-turn probe and the probe opening with a system turn share before their first
        roles part, as far as it ends the text after the answer there; at a token start. "" where the
        probes show no such text, or none that every probe ends with."""
        two, three = self._probe(_PROBE[:2], False), self._probe(_PROBE[:3], False)
        if two is None or three is None or two.startswith(plain):
            return ""
        answer = _PROBE[1]["content"]
        after = two.index(answer) + len(answer)
        region = two[after:]
        parting = common_prefix(region, three[three.index(answer) + len(answer):])
        try:
            first = self.render(Conversation([_SYSTEM_PROBE, _PROBE[0]]), False)
        except ConversationError:
            first = plain
        opening = plain[:common_prefix(plain, first)]
        shared = common_prefix(region[:parting][::-1], opening[::-1])
        start = max((int(s) - after for s in self._token_starts(two) if after <= s <= after + parting - shared),
                    default=0)
        trailer = region[start:]
        if trailer and all(text.endswith(trailer) for text in (plain, two, three)) and \
                two.startswith(plain[:-len(trailer)]):
            return trailer
        return ""

    def _token_ends(self, text: str) -> list[int]:
        return self.tokenizer.encode_with_offsets(text)[1][:, 1].tolist()

    def _token_starts(self, text: str) -> list[int]:
        return self.tokenizer.encode_with_offsets(text)[1][:, 0].tolist()

    def _probe_turn_ends(self) -> bool:
        """Whether the template closes an assistant turn with text of its own (a two-turn probe
        followed by the generation prompt); refused where nothing but whitespace separates an
        assistant turn from the next user turn. True where the probe cannot be rendered (a template
        that needs tools)."""
        text, prompted = self._probe(_PROBE, False), self._probe(_PROBE[:2], True)
        answer, next_user = _PROBE[1]["content"], _PROBE[2]["content"]
        if text is None or prompted is None or answer not in text or next_user not in text or answer not in prompted:
            return True
        if not text[text.index(answer) + len(answer):text.index(next_user)].strip():
            raise DataError(f"data.chat_template: {self.origin} renders nothing between an assistant turn and the next "
                            "user turn, so a turn's end cannot be told; use a template that separates turns")
        after = prompted[prompted.index(answer) + len(answer):]
        if self._headers.prompt and after.endswith(self._headers.prompt):
            after = after[:-len(self._headers.prompt)]
        return bool(after.strip())
