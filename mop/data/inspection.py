"""`mop data inspect`: conversations as `mop train` sees them, with the tokens the loss trains marked.

For each of the first `--rows` conversations of a source (rendered and masked as training and
`mop data prepare` do, `mop.data.templates`) or of a prepared folder: a header with where it is,
its token count, how many tokens are trained and their share, and whether it fits `--seq-len`
(and what `--overlong`, `data.overlong`, does with it when it does not), then its text with the
trained tokens marked: green on a terminal, between ⟦ and ⟧ otherwise (`--color`). A token is
trained when it is a target (`--loss-on`, `data.loss_on`), is not the conversation's first token
(no label predicts it) and lies within the tokens kept: the labels `mop.data.chat_packing` builds.
A row that cannot be used is shown with its one-line reason.
"""

from __future__ import annotations

import argparse
import sys
from itertools import islice

import numpy as np

from mop.data.chat_packing import trained_tokens, truncated_length
from mop.data.conversations import chat_files, conversation, iter_rows
from mop.data.errors import ConversationError
from mop.data.prepared import ChatSettings, is_prepared, open_prepared
from mop.data.templates import ChatTemplate

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
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="mark trained tokens in colour (auto: on a terminal) or between ⟦ and ⟧")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of rows")
    return int(text)


def run(args) -> None:
    settings = ChatSettings(args.tokenizer, args.chat_template)
    template = settings.template()
    marks = MARKS["color" if args.color == "always" or (args.color == "auto" and sys.stdout.isatty()) else "plain"]
    for where, encoded in islice(_encoded(args.source, settings, template), args.rows):
        print(show(where, encoded, template.tokenizer, args.seq_len, args.loss_on, args.overlong, marks), end="\n\n")


def _encoded(source: str, settings: ChatSettings, template: ChatTemplate):
    """`(where, (ids, targets) or the reason it cannot be used)` per conversation, in order."""
    if is_prepared(source):
        corpus = open_prepared(source, settings)
        for k in range(len(corpus.offsets) - 1):
            part = slice(int(corpus.offsets[k]), int(corpus.offsets[k + 1]))
            encoded = np.asarray(corpus.tokens[part]), np.asarray(corpus.targets[part], dtype=bool)
            yield f"{source} conversation {k}", encoded
        return
    for path in chat_files(source):
        for where, row in iter_rows(path):
            try:
                yield where, template.encode(conversation(row))
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
    bounds = [0, *(np.flatnonzero(np.diff(trained)) + 1).tolist(), len(ids)]  # runs of trained or untrained tokens
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        text = tokenizer.decode(ids[a:b], special=True)
        pieces.append(f"{marks[0]}{text}{marks[1]}" if trained[a] else text)
    body = "".join(pieces).removesuffix("\n")  # a rendering's last newline: the blank line after each row shows it
    return f"{header}\n{body}"
