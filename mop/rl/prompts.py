"""The RL loop's prompts (`rl.prompts`): a jsonl file, one prompt per row, each with the answer its
completions' rewards compare with.

A row is `{"prompt": ..., "answer": ...}`: the prompt as text (its tokens as the tokenizer encodes
them, nothing added), or as a list of messages (rendered with the chat template and its generation
prompt, as a model is asked to answer: `ChatTemplate.encode_prompt`); the answer as text (a number is
taken as its text). A bad row is one line naming the file and row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mop.data.conversations import Conversation, ConversationError, message_list
from mop.data.errors import DataError
from mop.data.rows import jsonl_lines


@dataclass(frozen=True)
class Prompts:
    """The prompts' token ids and answers, in file order, and a fingerprint of the file."""

    ids: list[list[int]]
    answers: list[str]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.ids)


def read_prompts(path: str, tokenizer, template) -> Prompts:
    """The rows of `path` encoded (module docstring); `template`: the chat template messages are
    rendered with (None: text prompts only)."""
    source = Path(path)
    if not source.is_file():
        raise DataError(f"rl.prompts: {path} is not a file; give a jsonl of {{\"prompt\": ..., \"answer\": ...}} rows")
    ids, answers = [], []
    for where, line in jsonl_lines(source):
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"rl.prompts: {where} is not valid JSON ({e})") from None
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise DataError(f"rl.prompts: {where} is not an object with 'prompt' and 'answer'")
        ids.append(_encoded(row["prompt"], tokenizer, template, where))
        answers.append(str(row["answer"]))
    if not ids:
        raise DataError(f"rl.prompts: {path} holds no prompt")
    return Prompts(ids, answers, hashlib.sha256(source.read_bytes()).hexdigest()[:16])


def _encoded(prompt, tokenizer, template, where: str) -> list[int]:
    if isinstance(prompt, str):
        encoded = list(tokenizer.encode(prompt))
    elif template is None:
        raise DataError(f"rl.prompts: {where}'s prompt is messages, which are rendered with a chat template; set "
                        "data.tokenizer to a Hugging Face tokenizer folder with one, or data.chat_template")
    else:
        try:
            encoded = [int(i) for i in template.encode_prompt(Conversation(message_list(prompt, "prompt")))]
        except ConversationError as e:
            raise DataError(f"rl.prompts: {where}: {e}") from None
    if not encoded:
        raise DataError(f"rl.prompts: {where}'s prompt is empty")
    return encoded
