"""Reading documents from the shipped corpus and from local files, never from the network.

A source (the ``data.source`` setting) is one of:

- ``"builtin"``: ``mop/data/corpus/corpus.jsonl``, a small CC0 corpus shipped as package data;
- a ``.txt`` file: the whole file split on blank lines (lines holding only whitespace count as
  blank), so each paragraph block is a document. Plain-text dumps rarely mark documents any
  other way, and a paragraph block, unlike the whole file, never straddles two of them;
- a ``.jsonl`` file: one JSON object per line, the document in field ``text_field``;
- a ``.parquet`` file: column ``text_field``, read in row batches with pyarrow;
- a ``.bin`` file: pre-tokenised, a flat little-endian array of ``bin_dtype`` (uint16 or uint32)
  ids with the tokenizer's eos id between documents. It is memory-mapped, never loaded;
- a directory: its supported files (not sub-directories, not hidden files), in sorted order.

Empty documents (and null texts) are skipped. Text sources are tokenized up front and held in
memory, which suits the corpora they are used for; large corpora belong in ``.bin`` files.
``load_token_stream`` returns the packed stream (see ``packing``) with one part per file, and a
document boundary at every file boundary, so a file without a trailing eos never merges with
the next. Every problem a user can fix is a one-line ``DataError`` naming the file.
"""

import json
import re
from collections.abc import Iterator
from importlib import resources
from itertools import islice
from pathlib import Path

import numpy as np

from mop.data.errors import DataError
from mop.data.packing import ConcatTokens, pack_documents
from mop.data.rows import jsonl_lines, read_text, table_rows
from mop.data.tokenizer import AnyTokenizer

SUFFIXES = (".txt", ".jsonl", ".parquet", ".bin")
BIN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_BLANK_LINES = re.compile(r"\n[ \t]*\n")
_ENCODE_BATCH = 512  # documents per encode_batch call: enough for the Rust tokenizer to batch
_SCAN_CHUNK = 1 << 24  # tokens per step when validating a .bin file


def builtin_corpus():
    """The shipped corpus, as an ``importlib.resources`` traversable."""
    return resources.files("mop.data") / "corpus" / "corpus.jsonl"


def source_files(source: str) -> list:
    """The files a source names, in reading order."""
    if source == "builtin":
        return [builtin_corpus()]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir()
            if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith(".")
        )
        if not files:
            raise DataError(
                f"data.source: directory {path} holds no {'/'.join(SUFFIXES)} files; "
                "point data.source at a directory of supported files"
            )
        return files
    if not path.is_file():
        raise DataError(
            f"data.source: {path} does not exist; set data.source to 'builtin', a "
            f"{'/'.join(SUFFIXES)} file or a directory of them"
        )
    if path.suffix not in SUFFIXES:
        raise DataError(
            f"data.source: {path} has unsupported extension {path.suffix!r}; "
            f"convert it to one of {', '.join(SUFFIXES)}"
        )
    return [path]


def _read_txt(path) -> Iterator[str]:
    text = read_text(path)
    yield from (doc.strip() for doc in _BLANK_LINES.split(text.replace("\r\n", "\n")))


def _checked_text(value, where: str, text_field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"data.source: {where} has a {type(value).__name__} in {text_field!r}, not "
                    "a string; set data.text_field to the field holding the text")


def _read_jsonl(path, text_field: str) -> Iterator[str]:
    for where, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"data.source: {where} is not valid JSON ({e}); fix the line "
                            "or remove it") from None
        if not isinstance(record, dict) or text_field not in record:
            fields = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
            raise DataError(f"data.source: {where} has no field {text_field!r} (fields: "
                            f"{fields}); set data.text_field to the field holding the text")
        yield _checked_text(record[text_field], where, text_field)


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # here, not at import: importing pyarrow starts a thread (`mop.data.rows`)

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise DataError(f"data.source: {path} is not a readable parquet file ({e}); "
                        "rewrite it with pyarrow") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(f"data.source: {path} has no column {text_field!r} (columns: "
                        f"{', '.join(names)}); set data.text_field to the text column")
    for where, row in table_rows(path, pf.iter_batches(batch_size=1024, columns=[text_field])):
        yield _checked_text(row[text_field], where, text_field)


def read_texts(path, text_field: str = "text") -> Iterator[str]:
    """The non-empty document texts of one ``.txt``, ``.jsonl`` or ``.parquet`` file."""
    suffix = Path(path.name).suffix
    if suffix == ".txt":
        texts = _read_txt(path)
    elif suffix == ".jsonl":
        texts = _read_jsonl(path, text_field)
    elif suffix == ".parquet":
        texts = _read_parquet(path, text_field)
    else:
        raise DataError(f"data.source: {path} is not a text file; use .txt, .jsonl or .parquet")
    return (t for t in texts if t)


def read_bin(path: Path, tokenizer: AnyTokenizer, bin_dtype: str = "uint16"):
    """Memory-map a pre-tokenised file and validate it; returns ``(tokens, doc_starts)``."""
    if bin_dtype not in BIN_DTYPES:
        raise DataError(f"data.bin_dtype = {bin_dtype!r} is not supported; set it to "
                        f"{' or '.join(map(repr, BIN_DTYPES))}")
    dtype = BIN_DTYPES[bin_dtype]
    if tokenizer.vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"data.bin_dtype = {bin_dtype!r} cannot hold the ids of tokenizer "
                        f"{tokenizer.name} (vocab size {tokenizer.vocab_size}), so {path} "
                        "cannot match it; set data.bin_dtype = 'uint32'")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"data.source: {path} has {size} bytes, not a multiple of "
                        f"{dtype.itemsize}; check data.bin_dtype ({bin_dtype!r})")
    # np.memmap refuses empty files; an empty file is simply no tokens.
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    ends = []
    for lo in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[lo : lo + _SCAN_CHUNK])
        if int(chunk.max()) >= tokenizer.vocab_size:
            at = lo + int(np.argmax(chunk >= tokenizer.vocab_size))
            raise DataError(
                f"data.source: {path} holds token id {int(tokens[at])} at position {at}, beyond "
                f"the vocab size {tokenizer.vocab_size} of tokenizer {tokenizer.name}; set "
                "data.tokenizer to the one it was written with, or check data.bin_dtype"
            )
        ends.append(np.flatnonzero(chunk == tokenizer.eos_id).astype(np.int64) + lo + 1)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), *ends])
    return tokens, starts[starts < len(tokens)]


def _encoded(texts: Iterator[str], tokenizer: AnyTokenizer) -> Iterator[list[int]]:
    while batch := list(islice(texts, _ENCODE_BATCH)):
        yield from (ids for ids in tokenizer.encode_batch(batch) if ids)


def iter_documents(source: str, tokenizer: AnyTokenizer, text_field: str = "text",
                   bin_dtype: str = "uint16") -> Iterator[list[int]]:
    """Every document of a source as token ids, without the eos that packing appends."""
    for path in source_files(source):
        if Path(path.name).suffix == ".bin":
            tokens, starts = read_bin(path, tokenizer, bin_dtype)
            for lo, hi in zip(starts, [*starts[1:], len(tokens)]):
                doc = np.asarray(tokens[lo:hi]).tolist()
                if doc and doc[-1] == tokenizer.eos_id:
                    doc.pop()
                if doc:
                    yield doc
        else:
            yield from _encoded(read_texts(path, text_field), tokenizer)


def load_token_stream(source: str, tokenizer: AnyTokenizer, text_field: str = "text",
                      bin_dtype: str = "uint16"):
    """The packed token stream of a source; returns ``(tokens, doc_starts)``."""
    parts, starts, offset = [], [], 0
    for path in source_files(source):
        if Path(path.name).suffix == ".bin":
            tokens, doc_starts = read_bin(path, tokenizer, bin_dtype)
        else:
            docs = _encoded(read_texts(path, text_field), tokenizer)
            tokens, doc_starts = pack_documents(docs, tokenizer.eos_id)
        if len(tokens):
            parts.append(tokens)
            starts.append(doc_starts + offset)
            offset += len(tokens)
    if not parts:
        raise DataError(f"data.source = {source!r} holds no documents; point it at non-empty data")
    tokens = parts[0] if len(parts) == 1 else ConcatTokens(parts)
    return tokens, np.concatenate(starts)
