"""`mop data inspect`: conversations as `mop train` sees them, with the tokens the loss trains marked.

First a line on the chat template: its generation blocks, or the generation prompt and the text
after the last message its probes found (`ChatTemplate.summary`). Then, for each of the first
`--rows` conversations of a source (rendered and masked as training and `mop data prepare` do,
`mop.data.templates`) or of a prepared folder: a header with where it is,
its token count, how many tokens are trained and their share, and whether it fits `--seq-len`
(and what `--overlong`, `data.overlong`, does with it when it does not), then its text with the
trained tokens marked: green on a terminal, between ⟦ and ⟧ otherwise (`--color`). A token is
trained when it is a target (`--loss-on`, `data.loss_on`), is not the conversation's first token
(no label predicts it) and lies within the tokens kept: the labels `mop.data.chat.packing` builds.
A row that cannot be used is shown with its one-line reason.

With `--format preference` each row is a preference pair (`mop.data.preference.rows`): a header with
where it is, its prompt's length, its unit's (`mop.data.preference.packing`: with the prompt once, or
twice with `--no-shared-prompt`) and what `--overlong` does with it at `--seq-len`; then its prompt,
once (its kept tokens only where it is cut from the left), and each response with its token count and
its trained tokens marked: its targets, or every token with `--loss-on all` (none when the pair is
dropped).
"""

from __future__ import annotations

import argparse
import sys
from itertools import islice

import numpy as np

from mop.data.chat.packing import trained_tokens
from mop.data.conversations import chat_files, iter_rows
from mop.data.errors import ConversationError
from mop.data.kinds import KINDS, open_prepared
from mop.data.packing import truncated_length
from mop.data.preference.packing import fitted_prompts, trained_response, unit_lengths
from mop.data.preference.rows import same_responses
from mop.data.prepared import ChatSettings, is_prepared

MARKS = {"color": ("\x1b[1;32m", "\x1b[0m"), "plain": ("⟦", "⟧")}


def add_arguments(parser, defaults) -> None:
    """`mop data inspect`'s arguments; `defaults` is a `DataConfig` (the settings' own defaults)."""
    parser.add_argument("source", help="conversations (.jsonl/.parquet file, folder, datasets folder) or a "
                        "prepared folder")
    parser.add_argument("--tokenizer", required=True, help="the model's Hugging Face tokenizer folder (data.tokenizer)")
    parser.add_argument("--chat-template", default=defaults.chat_template,
                        help="a Jinja template file instead of the tokenizer folder's (data.chat_template)")
    parser.add_argument("--rows", type=_positive, default=3, help="conversations to show, from the first (default 3)")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="data.seq_len, to tell overlong "
                        f"conversations (default {defaults.seq_len})")
    parser.add_argument("--loss-on", choices=("assistant", "all"), default=defaults.loss_on, help="data.loss_on")
    parser.add_argument("--overlong", choices=("drop", "truncate"), default=defaults.overlong, help="data.overlong")
    parser.add_argument("--format", choices=tuple(KINDS), default="chat", help="what the rows hold: conversations, "
                        "or preference pairs (data.format)")
    parser.add_argument("--shared-prompt", action=argparse.BooleanOptionalAction, default=defaults.shared_prompt,
                        help="with --format preference: a pair's unit length with its prompt once (data.shared_prompt)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="mark trained tokens in colour (auto: on a terminal) or between ⟦ and ⟧")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of rows")
    return int(text)


def run(args) -> None:
    settings = ChatSettings(args.tokenizer, args.chat_template, kind=args.format)
    encoder = KINDS[args.format].encoder(settings)
    marks = MARKS["color" if args.color == "always" or (args.color == "auto" and sys.stdout.isatty()) else "plain"]
    if encoder.template is not None:
        print(f"── {encoder.template.summary()}", end="\n\n")
    for where, encoded in islice(_encoded(args.source, settings, encoder), args.rows):
        what = (where, encoded, encoder.tokenizer, args.seq_len, args.loss_on, args.overlong, marks)
        print(show(*what) if args.format == "chat" else show_pair(*what, shared=args.shared_prompt), end="\n\n")


def _encoded(source: str, settings: ChatSettings, encoder):
    """`(where, the encoded row or the reason it cannot be used)` per row, in order."""
    if is_prepared(source):
        corpus = open_prepared(source, settings)
        for k in range(len(corpus.offsets) - 1):
            yield f"{source} {KINDS[settings.kind].unit} {k + 1}", corpus.item(k)
        return
    for path in chat_files(source):
        for where, row in iter_rows(path):
            try:
                yield where, encoder(row)
            except ConversationError as e:
                yield where, str(e)


def show(where: str, encoded, tokenizer, seq_len: int, loss_on: str, overlong: str, marks: tuple[str, str]) -> str:
    """One conversation's header and marked text (the module docstring)."""
    if isinstance(encoded, str):
        return f"── {where}: cannot be used: {encoded}"
    ids, targets = encoded
    trained = trained_tokens(targets, loss_on)
    fit = f"fits seq_len {seq_len}"
    if len(ids) > seq_len:
        kept = truncated_length(targets[:seq_len + 1]) if overlong == "truncate" else 0
        what = f"truncated to its first {kept} tokens" if kept else "dropped"
        fit = f"overlong ({len(ids)} > seq_len {seq_len}): {what} (data.overlong = {overlong})"
        trained[kept:] = False
    count = int(trained.sum())
    header = f"── {where}: {len(ids)} tokens, {count} trained ({count / max(len(ids), 1):.0%}), {fit}"
    return f"{header}\n{marked(ids, trained, tokenizer, marks)}"


def marked(ids: np.ndarray, trained: np.ndarray, tokenizer, marks: tuple[str, str]) -> str:
    """The text of `ids`, each run of trained tokens between the marks."""
    bounds = [0, *(np.flatnonzero(np.diff(trained)) + 1).tolist(), len(ids)]  # runs of trained or untrained tokens
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        text = tokenizer.decode(ids[a:b], special=True)
        pieces.append(f"{marks[0]}{text}{marks[1]}" if trained[a] else text)
    return "".join(pieces).removesuffix("\n")  # a rendering's last newline: the blank line after each row shows it


def show_pair(where: str, encoded, tokenizer, seq_len: int, loss_on: str, overlong: str, marks: tuple[str, str],
              shared: bool = True) -> str:
    """One preference pair's header, prompt and marked responses (the module docstring)."""
    if isinstance(encoded, str):
        return f"── {where}: cannot be used: {encoded}"
    ids, targets, (p, c, r) = encoded
    parts = np.array([[p, c, r]])
    kept = int(fitted_prompts(parts, seq_len, overlong, shared)[0][0])
    unit = int(unit_lengths(parts, parts[:, 0], shared)[0])
    fit = f"fits seq_len {seq_len}"
    if unit > seq_len:
        what = f"prompt cut to its last {kept} tokens" if kept else "dropped"
        fit = f"overlong ({unit} > seq_len {seq_len}): {what} (data.overlong = {overlong})"
    once = "once" if shared else "twice"
    shown = kept or p  # a dropped pair's whole prompt
    same = ", chosen and rejected the same tokens (degenerate)" if same_responses(ids, (p, c, r)) else ""
    lines = [f"── {where}: pair, prompt {p} tokens, unit {unit} tokens (the prompt {once}), {fit}{same}",
             "▸ prompt" + (f": its last {kept} tokens" if 0 < kept < p else ""),
             tokenizer.decode(ids[p - shown:p], special=True).removesuffix("\n")]
    for name, span in (("chosen", slice(p, p + c)), ("rejected", slice(p + c, p + c + r))):
        trained = trained_response(targets[span], loss_on) & (kept > 0)
        lines += [f"▸ {name}: {span.stop - span.start} tokens, {int(trained.sum())} trained",
                  marked(ids[span], trained, tokenizer, marks)]
    return "\n".join(lines)
