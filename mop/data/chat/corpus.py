"""Conversations encoded for training: each row's conversation (`mop.data.conversations`) rendered
with the chat template into token ids and assistant targets (`ChatRows`, `mop.data.templates`), held
as the shared `mop.data.prepared.Corpus` (item k: a conversation's ids and targets), and what a
prepared folder of them counts (`CHAT`, the kind `mop data prepare` writes by default).
"""

from __future__ import annotations

import numpy as np

from mop.data.conversations import conversation
from mop.data.prepared import Arrays, ChatSettings, Kind, histogram
from mop.data.templates import ChatTemplate


class ChatRows:
    """Conversation rows -> `(ids, targets)`, with a chat template."""

    def __init__(self, template: ChatTemplate):
        self.tokenizer, self.template = template.tokenizer, template

    def __call__(self, row) -> tuple[np.ndarray, np.ndarray]:
        return self.template.encode(conversation(row))


def _encoder(settings: ChatSettings) -> ChatRows:
    return ChatRows(settings.template())


def _counts(arrays: Arrays) -> dict:
    lengths = np.asarray(arrays.lengths)
    return {"conversations": len(lengths), "tokens": int(lengths.sum()), "targets": arrays.targets,
            "longest": int(lengths.max()), "length_histogram": histogram(lengths)}


def _said(m: dict) -> str:
    return f"{m['conversations']} conversations ({m['tokens']} tokens, "


CHAT = Kind("mop-chat", "conversation", "conversations with assistant turns", _encoder, _counts, _said)
