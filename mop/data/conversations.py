"""Conversation sources: rows of messages from jsonl, parquet and Hugging Face `datasets` folders.

A source (`data.source` with `data.format = "chat"`, or "preference": `mop.data.preference.rows` reads
its rows with `parse_row`, `message_list` and `row_tools`) is a `.jsonl` or `.parquet` file, a folder of
them (sorted, hidden files skipped), or a folder written by `datasets`' `save_to_disk` (its
`state.json` lists Arrow stream files, read with pyarrow; a `DatasetDict` folder, with
`dataset_dict.json`, is read through its "train" split). `datasets` itself is never imported.

A row holds its conversation in one of two forms:
- `messages`: a list of `{role, content, ...}` (OpenAI / Hugging Face form; roles system,
  developer, user, assistant, tool; an assistant's `tool_calls` and `reasoning_content` or
  `thinking`, a tool message's `name` or `tool_call_id`, all passed to the template as they are);
- `conversations` (ShareGPT): a list of `{from, value}`, mapped to `{role, content}` with `human` ->
  user, `gpt` -> assistant, `system` -> system, `tool`/`observation` -> tool.
An optional `tools` column (a list of JSON schemas, or a JSON string of one) goes to the template.

Parquet and Arrow give a column of structs one set of keys, in one order, with one type each, for
all its values: a key that only some have (an argument of one tool, a property of one tool's
parameters, in any row) reads back as None in all the others, keys come back in the column's order,
and an integer comes back as a float where another value of its key is one. Message keys that are
None are dropped, as transformers does, but nested ones reach the template, which renders them
(`"query": null`), as transformers' `apply_chat_template` does on the rows as read. To keep each
value's own keys and types, store `tools` as a JSON string (read back as the list it holds) and
tool-call arguments as JSON strings for a template that writes a string as it is (Qwen3's; gpt-oss's
quotes it), or use jsonl.

Rows are read one batch at a time (`iter_rows`), never a whole file; each comes with where it is
(`file row N`, from 1: `mop.data.rows`), which every error about it names. A jsonl row stays text until
`conversation` parses it (in the worker that encodes it, when preparing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mop.data.errors import ConversationError, DataError
from mop.data.rows import jsonl_lines, table_rows
from mop.data.templates import Conversation

ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool"}
SUFFIXES = (".jsonl", ".parquet")
_BATCH_ROWS = 256  # rows per pyarrow batch


def chat_files(source: str) -> list[Path]:
    """The files of a conversation source, in reading order."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            path = path / "train"
            if not path.is_dir():
                raise DataError(f"data.source: {path.parent} is a DatasetDict without a 'train' split; point "
                                "data.source at the split folder to read")
        if (path / "state.json").is_file():
            return _arrow_files(path)
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith("."))
        if not files:
            raise DataError(f"data.source: {path} holds no .jsonl/.parquet files and is no saved datasets folder "
                            "(state.json); point data.source at conversations or preference pairs")
        return files
    if not path.is_file():
        raise DataError(f"data.source: {path} does not exist; point data.source at a .jsonl/.parquet file of "
                        "conversations or preference pairs, a folder of them, a datasets folder or a prepared folder")
    if path.suffix not in SUFFIXES:
        raise DataError(f"data.source: {path} has extension {path.suffix!r}; conversations and preference "
                        "pairs are read from .jsonl, .parquet and datasets folders")
    return [path]


def _arrow_files(folder: Path) -> list[Path]:
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.source: {folder / 'state.json'} is not a datasets state file ({e}); save the "
                        "dataset again with save_to_disk") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(f"data.source: {folder} lacks {', '.join(missing)} listed in its state.json; save the "
                        "dataset again with save_to_disk")
    return files


def iter_rows(path: Path) -> Iterator[tuple[str, dict | str]]:
    """`(where, row)` for every row of one file (a jsonl row as its line: `conversation` parses it, in
    a worker process when preparing); `where` is `mop.data.rows.row_name`'s."""
    # pyarrow is imported by the branch that reads with it: its import starts a thread (`mop.data.rows`)
    if path.suffix == ".jsonl":
        yield from jsonl_lines(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
            raise DataError(f"data.source: {path} is not a readable parquet file ({e}); rewrite it") from None
        yield from table_rows(path, batches)
    else:
        import pyarrow as pa

        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except Exception as e:
            raise DataError(f"data.source: {path} is not a readable Arrow stream ({e}); save the dataset again "
                            "with save_to_disk") from None
        yield from table_rows(path, reader)


def conversation(row) -> Conversation:
    """The conversation of one row, a dict or a JSON line (the module docstring); a
    `ConversationError` says what is wrong."""
    row = parse_row(row, "'messages' or 'conversations'")
    if row.get("messages") is not None:
        messages = message_list(row["messages"], "messages")
    elif row.get("conversations") is not None:
        messages = [_sharegpt(m, k) for k, m in enumerate(_listed(row["conversations"], "conversations"))]
    else:
        raise ConversationError(f"it has no 'messages' or 'conversations' (fields: {present_fields(row)})")
    return Conversation(messages, row_tools(row))


def parse_row(row, fields: str) -> dict:
    """A row as a dict: a JSON line parsed, anything but an object refused (`fields`: what it should hold)."""
    if isinstance(row, str):
        try:
            row = json.loads(row)
        except ValueError as e:
            raise ConversationError(f"it is not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise ConversationError(f"it is a {type(row).__name__}, not an object with {fields}")
    return row


def present_fields(row: dict) -> str:
    """The fields a row has values in (a parquet row has every column), for an error message."""
    return ", ".join(repr(key) for key, value in row.items() if value is not None) or "none"


def message_list(value, field: str) -> list[dict]:
    """A non-empty list of `{role, content, ...}` messages (the module docstring), each checked."""
    return [_message(m, k) for k, m in enumerate(_listed(value, field))]


def row_tools(row: dict) -> list[dict] | None:
    """A row's `tools`: a list of JSON schemas, or a JSON string of one (None: no tools)."""
    tools = row.get("tools")
    if isinstance(tools, str) and not tools.strip():  # a string column's empty value: no tools
        tools = None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ConversationError(f"its 'tools' is not JSON ({e})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConversationError("its 'tools' is not a list of JSON schemas")
    return tools or None


def _listed(value, field: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConversationError(f"its {field!r} is not a non-empty list")
    return value


def _message(message, index: int) -> dict:
    if not isinstance(message, dict) or "role" not in message:
        raise ConversationError(f"message {index} has no 'role'")
    if message["role"] not in ROLES:
        raise ConversationError(f"message {index} has role {message['role']!r}; roles are {', '.join(ROLES)}")
    return dict(message)


def _sharegpt(message, index: int) -> dict:
    if not isinstance(message, dict) or "from" not in message:
        raise ConversationError(f"conversations entry {index} has no 'from'")
    role = SHAREGPT_ROLES.get(message["from"]) if isinstance(message["from"], str) else None
    if role is None:
        raise ConversationError(f"conversations entry {index} is from {message['from']!r}; ShareGPT roles are "
                                f"{', '.join(SHAREGPT_ROLES)}")
    return {"role": role, "content": message.get("value")}
