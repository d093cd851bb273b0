"""Conversations and preference pairs encoded once: token ids, target masks and item boundaries, in
memory or in a prepared folder of memory-mapped arrays.

A `Corpus` is what training packs: `tokens [T]`, `targets [T]` (1 where the token is an assistant
target, `mop.data.templates`) and `offsets [n + 1]` (item k is `tokens[offsets[k]:offsets[k + 1]]`):
a conversation (`mop.data.chat`), or a preference pair's prompt, chosen and rejected tokens one
after the other (targets 0 on the prompt; `mop.data.preference.corpus.PreferenceCorpus`, with
`parts [n, 3]` their lengths). The kind (`ChatSettings.kind`, data.format "chat" or "preference")
decides how a row is encoded and what the manifest counts: its format package's `Kind`, picked by
`mop.data.kinds`; everything else is here, shared. A corpus comes from either
- a source read at start-up (`encode`; `mop.data.kinds.encode_source`, in this process: small sets),
  or
- a prepared folder (`read`; `mop.data.kinds.open_prepared`): `mop data prepare SOURCE --tokenizer
  DIR --out DIR [--format preference]` once (`write`), then any run at any `data.seq_len`
  memory-maps it.

A prepared folder holds `tokens.bin` (uint16 when the vocabulary fits, else uint32), `targets.bin`
(uint8), `offsets.npy` (int64), for pairs `parts.npy` (int64 [n, 3]), and `manifest.json`: the
format ("mop-chat" or "mop-preference") and its version, the source and its fingerprint (file
names, sizes and sampled bytes), the tokenizer's fingerprint (sha256 of its tokenizer.json), the
template's sha256 and origin (None for pairs encoded without a template: plain rows), the version
of the assistant targets' definition (`mop.data.templates.TARGETS_VERSION`), the counts
(conversations, tokens, targets and a length histogram; or pairs, prompt and response tokens,
targets, a histogram of the shared-prompt unit lengths p + c + 1 + r and the degenerate pairs kept,
with examples) and the skipped rows with examples. A run whose data.format, tokenizer, template or
targets' version differ from the manifest's is refused in one line (`data.seq_len`, `data.loss_on`, `data.overlong` and
`data.shared_prompt` apply when sequences are built, so one folder serves them all).

`write` (`mop data prepare`) streams: the main process reads rows a chunk at a time, `workers`
processes render and tokenize the chunks (at most two chunks per worker in flight, collected in
order), and the main process appends each chunk's arrays to the files; memory holds a few chunks and
the lengths (8 bytes per conversation, 32 per pair), never the source. The folder is written under a
temporary name and renamed when complete, so an interrupted run never leaves a folder that looks
prepared.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import types
from array import array
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from mop.data.conversations import chat_files, iter_rows
from mop.data.errors import ConversationError, DataError
from mop.data.templates import TARGETS_CHANGES, TARGETS_VERSION, ChatTemplate, folder_template, read_template
from mop.data.tokenizer import HFTokenizer, load_tokenizer

MANIFEST = "manifest.json"
VERSION = 1
_CHUNK_ROWS = 64  # rows per worker task
_EXAMPLES = 10  # rows a manifest names of those skipped (and of the flagged items kept: degenerate pairs)


@dataclass(frozen=True)
class ChatSettings:
    """What turns rows into tokens and targets: picklable, so worker processes rebuild the template."""

    tokenizer: str
    """The tokenizer folder (or tokenizer.json)."""
    chat_template: str = ""
    """A template file overriding the tokenizer folder's ("" : the folder's)."""
    skip_invalid: bool = False
    """Count and skip a row that cannot be used, instead of stopping with its error (and a degenerate
    preference pair, `mop.data.preference.rows.same_responses`, instead of keeping it)."""
    kind: Literal["chat", "preference", "rollouts"] = "chat"
    """What the rows hold: conversations, preference pairs (`mop.data.preference`) or recorded rollouts
    (`mop.data.rollouts`, read by their own encoder: they are never prepared)."""

    def template(self, required: bool = True) -> ChatTemplate | None:
        """The chat template; without `required`, None where data.tokenizer has none and
        data.chat_template names none (plain preference rows need none)."""
        tokenizer = load_tokenizer(self.tokenizer)
        hf = isinstance(tokenizer, HFTokenizer)
        if not (required or self.chat_template or (hf and folder_template(tokenizer.directory))):
            return None
        if not hf:
            raise DataError("data.tokenizer: chat data needs a Hugging Face tokenizer folder (its chat template and "
                            "special tokens); set data.tokenizer to one")
        source, origin = read_template(tokenizer.directory, self.chat_template)
        return ChatTemplate(source, origin, tokenizer)


@dataclass
class Corpus:
    """Encoded items (the module docstring) and how they were made: a chat corpus as it is."""

    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    fingerprint: str
    skipped: int = 0

    @classmethod
    def of(cls, tokens, targets, offsets, fingerprint: str, skipped: int, parts, counts: dict) -> Corpus:
        """The corpus of encoded arrays; `parts` (None: the kind has none) and the manifest's `counts` are
        for a kind that keeps more."""
        return cls(tokens, targets, offsets, fingerprint, skipped)

    def item(self, k: int) -> tuple:
        """Item k as encoded: `(ids, targets)`."""
        part = slice(int(self.offsets[k]), int(self.offsets[k + 1]))
        return np.asarray(self.tokens[part]), np.asarray(self.targets[part], dtype=bool)


@dataclass(frozen=True)
class Kind:
    """What differs between the kinds of rows (the module docstring): each format package that
    prepares its rows defines one, of module-level functions (workers receive it pickled)."""

    format: str
    """The manifest's format."""
    unit: str
    """One encoded row, as messages name it."""
    wanted: str
    """What a source of this kind holds, as messages say it."""
    encoder: Callable[[ChatSettings], Callable]
    """What encodes one row: `encoder(row)` is the item `(ids, targets, *parts)`, or a ConversationError
    saying why not; `encoder.tokenizer` and `encoder.template` (None: rows encoded without one) made it."""
    counts: Callable[[Arrays], dict]
    """The manifest's counts of the encoded rows."""
    said: Callable[[dict], str]
    """How many were prepared, from the manifest: `mop data prepare`'s line."""
    corpus: type[Corpus] = Corpus
    """What holds them (`Corpus.of`)."""
    parts: bool = False
    """Whether its items carry parts (a pair's prompt, chosen and rejected lengths), kept in parts.npy."""
    flagged: Callable[[np.ndarray, tuple], bool] | None = None
    """An item kept but counted, the first few named (a degenerate pair), from its ids and parts."""


def encode_rows(encoder, rows: list[tuple[str, dict]], skip_invalid: bool) -> list[tuple[str, object]]:
    """`(where, item)` for each row (`Kind.encoder`), the item a str for an unusable row with
    `skip_invalid`: its one-line reason. Without `skip_invalid` the first unusable row raises a
    `DataError` naming it."""
    out = []
    for where, row in rows:
        try:
            out.append((where, encoder(row)))
        except ConversationError as e:
            if not skip_invalid:
                raise DataError(f"data.source: {where}: {e}; fix the row, or set data.skip_invalid = true "
                                "to count and skip such rows") from None
            out.append((where, str(e)))
    return out


_worker_encoder = None
_worker_skip = False


def _start_worker(settings: ChatSettings, kind: Kind) -> None:
    global _worker_encoder, _worker_skip
    _worker_encoder, _worker_skip = kind.encoder(settings), settings.skip_invalid


def _encode_chunk(rows):
    """A worker's chunk: compact arrays (and reasons), or the DataError's message to re-raise in the parent."""
    try:
        encoded = encode_rows(_worker_encoder, rows, _worker_skip)
    except DataError as e:
        return str(e)
    dtype = _token_dtype(_worker_encoder.tokenizer)  # the files' own types: the parent only appends
    return [(where, e if isinstance(e, str) else (e[0].astype(dtype), e[1].astype(np.uint8), *e[2:]))
            for where, e in encoded]


def _chunks(source: str):
    rows = (row for path in chat_files(source) for row in iter_rows(path))
    while chunk := list(islice(rows, _CHUNK_ROWS)):
        yield chunk


def source_fingerprint(source: str) -> str:
    """Names, sizes and 64 sampled 4 KiB blocks of each file: a changed source is caught without
    reading gigabytes at every start."""
    h = hashlib.blake2b(digest_size=8)
    for path in chat_files(source):
        size = path.stat().st_size
        h.update(f"{path.name}/{size}".encode())
        with path.open("rb") as f:
            for k in range(64):
                f.seek((max(size - 4096, 0) * k) // 63)
                h.update(f.read(4096))
    return h.hexdigest()


class Arrays:
    """Appends encoded items to the token and target files (or lists), recording lengths (and an item's
    parts) and counts."""

    def __init__(self, folder: Path | None, token_dtype, flagged: Callable[[np.ndarray, tuple], bool] | None = None):
        self.token_dtype = token_dtype
        self.files = None if folder is None else (open(folder / "tokens.bin", "wb"), open(folder / "targets.bin", "wb"))
        self.held: tuple[list, list] = ([], [])
        self.lengths = array("q")
        self.item_parts = array("q")  # each item's parts (a pair's p, c, r), one after the other
        self.targets = 0
        self.skipped = 0
        self.examples: list[str] = []  # of skipped rows, the first few
        self.is_flagged = flagged
        self.flagged = 0
        self.flagged_examples: list[str] = []  # where the first few flagged items kept are

    def add(self, encoded: list[tuple[str, object]]) -> None:
        for where, item in encoded:
            if isinstance(item, str):
                self.skipped += 1
                if len(self.examples) < _EXAMPLES:
                    self.examples.append(f"{where}: {item}")
                continue
            ids, targets = item[0].astype(self.token_dtype, copy=False), item[1].astype(np.uint8, copy=False)
            self.lengths.append(len(ids))
            if len(item) > 2:  # its parts (a pair's p, c, r)
                self.item_parts.extend(item[2])
                if self.is_flagged is not None and self.is_flagged(ids, item[2]):
                    self.flagged += 1
                    if len(self.flagged_examples) < _EXAMPLES:
                        self.flagged_examples.append(where)
            self.targets += int(targets.sum())
            if self.files is None:
                self.held[0].append(ids)
                self.held[1].append(targets)
            else:
                self.files[0].write(ids.tobytes())
                self.files[1].write(targets.tobytes())

    def close(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.close()

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(np.frombuffer(self.lengths, dtype=np.int64))]).astype(np.int64)

    def parts(self) -> np.ndarray:
        return np.frombuffer(self.item_parts, dtype=np.int64).reshape(-1, 3)


def histogram(lengths: np.ndarray) -> dict[str, int]:
    """How many lengths lie in each (2^(k-1), 2^k]."""
    exponents = np.bincount(np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    return {f"<= {1 << k}": int(n) for k, n in enumerate(exponents) if n}


def _token_dtype(tokenizer) -> np.dtype:
    return np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<u4")


def _check_some(arrays: Arrays, source: str, kind: Kind) -> None:
    if not arrays.lengths:
        why = f" ({arrays.skipped} skipped, e.g. {arrays.examples[0]})" if arrays.skipped else ""
        raise DataError(f"data.source = {source!r} holds no usable {kind.unit}{why}; point it at {kind.wanted}")


def encode(source: str, settings: ChatSettings, kind: Kind) -> Corpus:
    """A source encoded in this process, held in memory (for small sets; large ones are prepared once)."""
    encoder = kind.encoder(settings)
    arrays = Arrays(None, _token_dtype(encoder.tokenizer), kind.flagged)
    for chunk in _chunks(source):
        arrays.add(encode_rows(encoder, chunk, settings.skip_invalid))
    _check_some(arrays, source, kind)
    tokens, targets = (np.concatenate(p) for p in arrays.held)
    template = "" if encoder.template is None else encoder.template.hash
    # a chat corpus's fingerprint as before pairs existed: a run resumed on the same data still matches
    tag = "" if settings.kind == "chat" else f"/{settings.kind}"
    made = f"{source_fingerprint(source)}/{encoder.tokenizer.fingerprint}/{template}{tag}"
    fingerprint = hashlib.blake2b(made.encode(), digest_size=8).hexdigest()
    return kind.corpus.of(tokens, targets.astype(bool), arrays.offsets(), fingerprint, arrays.skipped,
                          arrays.parts() if kind.parts else None, kind.counts(arrays))


def is_prepared(source: str) -> bool:
    return (Path(source).expanduser() / MANIFEST).is_file()


def write(source: str, settings: ChatSettings, kind: Kind, out: str, workers: int = 0, progress: bool = True) -> dict:
    """Encode `source` into the prepared folder `out` (the module docstring); returns the manifest."""
    encoder = kind.encoder(settings)
    chat_files(source)  # a missing or unreadable source is said before any worker starts
    out_path = Path(out).expanduser()
    if out_path.is_file() or (out_path.is_dir() and any(out_path.iterdir())):
        raise DataError(f"--out: {out_path} exists and is not empty; choose a new folder (prepared data is never "
                        "overwritten)")
    partial = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    token_dtype = _token_dtype(encoder.tokenizer)
    arrays = Arrays(partial, token_dtype, kind.flagged)
    workers = workers or os.cpu_count() or 1
    try:
        with _workers(workers, settings, kind) as pool, _progress_bar(progress, kind.unit) as bar:
            pending = deque()  # chunks in flight, in order: at most two per worker

            def collect():
                encoded = pending.popleft().get()
                if isinstance(encoded, str):
                    raise DataError(encoded)
                arrays.add(encoded)
                bar.update(len(encoded))

            for chunk in _chunks(source):
                pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(pending) >= 2 * workers:
                    collect()
            while pending:
                collect()
        arrays.close()
        _check_some(arrays, source, kind)
        np.save(partial / "offsets.npy", arrays.offsets())
        if kind.parts:
            np.save(partial / "parts.npy", arrays.parts())
        manifest = _manifest(source, kind, encoder, arrays, token_dtype)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out_path.exists():
            out_path.rmdir()
        partial.rename(out_path)
        return manifest
    finally:
        arrays.close()
        shutil.rmtree(partial, ignore_errors=True)


@contextmanager
def _workers(count: int, settings: ChatSettings, kind: Kind):
    """A pool of `count` spawned workers that import `mop.data.prepared` and the kind's module alone. A
    spawned process first imports the parent's main module (`mop`'s command line, which imports torch:
    seconds and about 200 MB per worker); the main module is hidden while the workers start, which they
    do in `Pool()`, since they need nothing of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        pool = multiprocessing.get_context("spawn").Pool(count, _start_worker, (settings, kind))
    finally:
        sys.modules["__main__"] = main
    with pool:
        yield pool


def _progress_bar(enabled: bool, unit: str):
    from tqdm import tqdm

    return tqdm(unit=f" {unit}s", disable=not enabled, smoothing=0.1)


def _manifest(source, kind: Kind, encoder, arrays: Arrays, token_dtype) -> dict:
    template = encoder.template
    return {"format": kind.format, "version": VERSION, "targets_version": TARGETS_VERSION,
            "source": str(source), "source_fingerprint": source_fingerprint(source),
            "tokenizer": encoder.tokenizer.name, "tokenizer_fingerprint": encoder.tokenizer.fingerprint,
            "template_origin": template and template.origin, "template_sha256": template and template.hash,
            "token_dtype": token_dtype.str, **kind.counts(arrays), "skipped": arrays.skipped,
            "skipped_examples": arrays.examples}


def read(folder: Path, manifest: dict, settings: ChatSettings, kind: Kind) -> Corpus:
    """A prepared folder of `kind` (its `manifest` read), memory-mapped, after checking it was made with
    this run's tokenizer and template."""
    made = manifest.get("targets_version", 1)
    if made != TARGETS_VERSION:
        changes = "; ".join(TARGETS_CHANGES[v] for v in range(made + 1, TARGETS_VERSION + 1))
        raise DataError(f"data.source: {folder} was prepared with mop's earlier assistant targets (version {made}, now "
                        f"{TARGETS_VERSION}: {changes}); prepare it again with mop data prepare")
    encoder = kind.encoder(settings)
    mine = {"tokenizer_fingerprint": ("tokenizer", encoder.tokenizer.fingerprint, "data.tokenizer"),
            "template_sha256": ("chat template", encoder.template and encoder.template.hash, "data.chat_template")}
    for key, (what, value, setting) in mine.items():
        if manifest.get(key) != value:
            raise DataError(f"data.source: {folder} was prepared with another {what} than this run's {setting} "
                            f"({manifest.get(key)!r} there, {value!r} here); set {setting} to the one it was prepared "
                            "with, or prepare the source again")
    dtype = np.dtype(manifest["token_dtype"])
    offsets = _load(folder / "offsets.npy")
    parts = _load(folder / "parts.npy") if kind.parts else None
    tokens, targets = (_memmap(folder / name, t) for name, t in (("tokens.bin", dtype), ("targets.bin", np.uint8)))
    items = len(offsets) - 1
    if len(tokens) != offsets[-1] or len(targets) != offsets[-1] or (parts is not None and len(parts) != items):
        raise DataError(f"data.source: {folder}'s arrays disagree with its offsets (truncated copy?); prepare it again")
    fingerprint = hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=8).hexdigest()
    return kind.corpus.of(tokens, targets, np.asarray(offsets), fingerprint, manifest["skipped"], parts, manifest)


def read_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"data.source: {folder / MANIFEST} is not valid JSON ({e}); prepare the folder again") from None


def other_format(source, kind: str) -> DataError:
    """The error for a prepared folder of `kind` read as data of another data.format."""
    return DataError(f"data.source: {source} is a prepared {kind} folder; set data.format = '{kind}'")


def _load(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"data.source: {path} is missing from the prepared folder; prepare it again")
    return np.load(path, mmap_mode="r")


def _memmap(path: Path, dtype) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"data.source: {path} is missing from the prepared folder; prepare it again")
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=dtype)
