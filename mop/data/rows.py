"""Rows of data files, read a line or a batch at a time and named alike in every message.

A row is named `<file> row <N>`, N counted from 1 within its file: a jsonl file's line (blank lines
counted, so N is the line an editor shows), a parquet file's or a `datasets` Arrow file's row (what
`pyarrow` reads, row groups and record batches in order). A jsonl line is decoded on its own, so a
byte that is not UTF-8 is reported with the row holding it, and a file is never decoded whole.

pyarrow is imported where a parquet or Arrow file is read, not when mop is: importing it starts
jemalloc's background thread, and importing mop must start none (the tests fork ranks from a
process that has imported mop, `mop.testing.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from mop.data.errors import DataError


def row_name(path, number: int) -> str:
    """How every message names row `number` (from 1) of file `path`."""
    return f"{path} row {number}"


def not_utf8(where: str, e: UnicodeDecodeError) -> DataError:
    """The one line for undecodable bytes: `where` names the row or line `e` decoded."""
    return DataError(f"data.source: {where} is not valid UTF-8 ({e.reason} at its byte {e.start + 1}); re-encode "
                     "the file as UTF-8")


def read_text(path: Path) -> str:
    """A text file's whole text; undecodable bytes are named by their line (from 1)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        newline = b"\n"
        start = data.rfind(newline, 0, e.start) + 1
        in_line = UnicodeDecodeError(e.encoding, e.object, e.start - start, e.end - start, e.reason)
        raise not_utf8(f"{path} line {data.count(newline, 0, e.start) + 1}", in_line) from None


def jsonl_lines(path: Path) -> Iterator[tuple[str, str]]:
    """`(row name, text)` of every non-blank line of a jsonl file, each decoded on its own."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8(row_name(path, number), e) from None
            if line.strip():
                yield row_name(path, number), line


def table_rows(path: Path, batches: Iterable) -> Iterator[tuple[str, dict]]:
    """`(row name, row)` of every row of a parquet or Arrow file's record batches."""
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield row_name(path, number), row
