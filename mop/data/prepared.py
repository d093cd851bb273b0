"""Conversations and preference pairs encoded once: token ids, target masks and item boundaries, in
memory or in a prepared folder of memory-mapped arrays.

`ChatCorpus` is what training packs (`mop.data.chat_packing`): `tokens [T]`, `targets [T]` (1 where
the token is an assistant target, `mop.data.templates`) and `offsets [n + 1]` (conversation k is
`tokens[offsets[k]:offsets[k + 1]]`). `PreferenceCorpus` holds preference pairs the same way
(`mop.data.preferences`; packed by `mop.data.preference_packing`): item k is a pair's prompt,
chosen and rejected tokens one after the other (targets 0 on the prompt), `parts [n, 3]` their
lengths. The kind (`ChatSettings.kind`, data.format "chat" or "preference") decides how a row is
encoded (`ChatSettings.encoder`) and what the manifest counts; everything else is shared. A corpus
comes from either
- a source read at start-up (`encode_source`, in this process: small sets), or
- a prepared folder (`open_prepared`): `mop data prepare SOURCE --tokenizer DIR --out DIR [--format
  preference]` once (`prepare`), then any run at any `data.seq_len` memory-maps it.

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

`prepare` streams: the main process reads rows a chunk at a time, `workers` processes render and
tokenize the chunks (at most two chunks per worker in flight, collected in order), and the main
process appends each chunk's arrays to the files; memory holds a few chunks and the lengths (8
bytes per conversation, 32 per pair), never the source. The folder is written under a temporary
name and renamed when complete, so an interrupted run never leaves a folder that looks prepared.
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
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from mop.data.conversations import chat_files, conversation, iter_rows
from mop.data.errors import ConversationError, DataError
from mop.data.preferences import PreferenceRows, same_responses
from mop.data.templates import TARGETS_CHANGES, TARGETS_VERSION, ChatTemplate, folder_template, read_template
from mop.data.tokenizer import HFTokenizer, load_tokenizer

MANIFEST = "manifest.json"
VERSION = 1
_CHUNK_ROWS = 64  # rows per worker task
_EXAMPLES = 10  # rows a manifest names of those skipped (and of the degenerate pairs kept)


@dataclass(frozen=True)
class ChatSettings:
    """What turns rows into tokens and targets: picklable, so worker processes rebuild the template."""

    tokenizer: str
    """The tokenizer folder (or tokenizer.json)."""
    chat_template: str = ""
    """A template file overriding the tokenizer folder's ("" : the folder's)."""
    skip_invalid: bool = False
    """Count and skip a row that cannot be used, instead of stopping with its error (and a degenerate
    preference pair, `mop.data.preferences.same_responses`, instead of keeping it)."""
    kind: Literal["chat", "preference", "rollouts"] = "chat"
    """What the rows hold: conversations, preference pairs (`mop.data.preferences`) or recorded rollouts
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

    def encoder(self) -> ChatRows | PreferenceRows:
        """What encodes one row: `encoder(row)` is the item, or a ConversationError saying why not;
        `encoder.tokenizer` and `encoder.template` (None: plain pairs without one) made it."""
        if self.kind == "chat":
            return ChatRows(self.template())
        template = self.template(required=False)
        tokenizer = load_tokenizer(self.tokenizer) if template is None else template.tokenizer
        return PreferenceRows(tokenizer, template, drop_degenerate=self.skip_invalid)


class ChatRows:
    """Conversation rows -> `(ids, targets)`, with a chat template."""

    def __init__(self, template: ChatTemplate):
        self.tokenizer, self.template = template.tokenizer, template

    def __call__(self, row) -> tuple[np.ndarray, np.ndarray]:
        return self.template.encode(conversation(row))


@dataclass
class ChatCorpus:
    """Encoded conversations (the module docstring) and how they were made."""

    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    fingerprint: str
    skipped: int = 0

    def item(self, k: int) -> tuple:
        """Item k as encoded: `(ids, targets)`."""
        part = slice(int(self.offsets[k]), int(self.offsets[k + 1]))
        return np.asarray(self.tokens[part]), np.asarray(self.targets[part], dtype=bool)


@dataclass
class PreferenceCorpus(ChatCorpus):
    """Encoded preference pairs (the module docstring): item k is prompt | chosen | rejected."""

    parts: np.ndarray = field(kw_only=True)
    """int64 [n, 3]: each pair's prompt, chosen and rejected lengths."""
    degenerate_pairs: int = field(kw_only=True, default=0)
    """How many of its pairs are degenerate (`mop.data.preferences.same_responses`)."""
    degenerate_examples: list[str] = field(kw_only=True, default_factory=list)
    """Where the first few of them are in the source."""

    def item(self, k: int) -> tuple:
        """Pair k as encoded: `(ids, targets, (p, c, r))`."""
        return *super().item(k), tuple(int(n) for n in self.parts[k])


@dataclass(frozen=True)
class _Kind:
    """What differs between the kinds of rows (the module docstring)."""

    format: str
    """The manifest's format."""
    unit: str
    """One encoded row, as messages name it."""
    wanted: str
    """What a source of this kind holds, as messages say it."""
    counts: Callable[[_Arrays], dict]
    """The manifest's counts of the encoded rows."""
    said: Callable[[dict], str]
    """How many were prepared, from the manifest: `mop data prepare`'s line."""


def encode_rows(encoder, rows: list[tuple[str, dict]], skip_invalid: bool) -> list[tuple[str, object]]:
    """`(where, item)` for each row (`ChatSettings.encoder`), the item a str for an unusable row with
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


_worker_encoder: ChatRows | PreferenceRows | None = None
_worker_skip = False


def _start_worker(settings: ChatSettings) -> None:
    global _worker_encoder, _worker_skip
    _worker_encoder, _worker_skip = settings.encoder(), settings.skip_invalid


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


class _Arrays:
    """Appends encoded items to the token and target files (or lists), recording lengths (and a pair's
    parts) and counts."""

    def __init__(self, folder: Path | None, token_dtype):
        self.token_dtype = token_dtype
        self.files = None if folder is None else (open(folder / "tokens.bin", "wb"), open(folder / "targets.bin", "wb"))
        self.held: tuple[list, list] = ([], [])
        self.lengths = array("q")
        self.pair_parts = array("q")  # p, c, r of each pair, one after the other
        self.targets = 0
        self.skipped = 0
        self.examples: list[str] = []  # of skipped conversations, the first few
        self.degenerate = 0
        self.degenerate_examples: list[str] = []  # where the first few degenerate pairs kept are

    def add(self, encoded: list[tuple[str, object]]) -> None:
        for where, item in encoded:
            if isinstance(item, str):
                self.skipped += 1
                if len(self.examples) < _EXAMPLES:
                    self.examples.append(f"{where}: {item}")
                continue
            ids, targets = item[0].astype(self.token_dtype, copy=False), item[1].astype(np.uint8, copy=False)
            self.lengths.append(len(ids))
            if len(item) > 2:  # a preference pair
                self.pair_parts.extend(item[2])
                if same_responses(ids, item[2]):
                    self.degenerate += 1
                    if len(self.degenerate_examples) < _EXAMPLES:
                        self.degenerate_examples.append(where)
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
        return np.frombuffer(self.pair_parts, dtype=np.int64).reshape(-1, 3)


def _histogram(lengths: np.ndarray) -> dict[str, int]:
    """How many lengths lie in each (2^(k-1), 2^k]."""
    exponents = np.bincount(np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    return {f"<= {1 << k}": int(n) for k, n in enumerate(exponents) if n}


def _chat_counts(arrays: _Arrays) -> dict:
    lengths = np.asarray(arrays.lengths)
    return {"conversations": len(lengths), "tokens": int(lengths.sum()), "targets": arrays.targets,
            "longest": int(lengths.max()), "length_histogram": _histogram(lengths)}


def _pair_counts(arrays: _Arrays) -> dict:
    parts = arrays.parts()
    units = parts.sum(1) + 1  # [P | C] then the branch [P[-1] | R] (mop.data.preference_packing)
    return {"pairs": len(parts), "tokens": int(parts.sum()), "prompt_tokens": int(parts[:, 0].sum()),
            "response_tokens": int(parts[:, 1:].sum()), "targets": arrays.targets, "longest_unit": int(units.max()),
            "unit_length_histogram": _histogram(units), "degenerate_pairs": arrays.degenerate,
            "degenerate_examples": arrays.degenerate_examples}


KINDS = {
    "chat": _Kind("mop-chat", "conversation", "conversations with assistant turns", _chat_counts,
                  lambda m: f"{m['conversations']} conversations ({m['tokens']} tokens, "),
    "preference": _Kind("mop-preference", "pair", "preference pairs (prompt, chosen, rejected)", _pair_counts,
                        lambda m: f"{m['pairs']} pairs ({m['prompt_tokens']} prompt and {m['response_tokens']} "
                                  f"response tokens, {m['degenerate_pairs']} degenerate, "),
}


def _token_dtype(tokenizer) -> np.dtype:
    return np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<u4")


def _check_some(arrays: _Arrays, source: str, kind: str) -> None:
    if not arrays.lengths:
        why = f" ({arrays.skipped} skipped, e.g. {arrays.examples[0]})" if arrays.skipped else ""
        raise DataError(f"data.source = {source!r} holds no usable {KINDS[kind].unit}{why}; point it at "
                        f"{KINDS[kind].wanted}")


def _corpus(kind: str, tokens, targets, offsets, fingerprint: str, skipped: int, parts,
            degenerate: tuple[int, list[str]] = (0, [])) -> ChatCorpus:
    if kind == "chat":
        return ChatCorpus(tokens, targets, offsets, fingerprint, skipped)
    return PreferenceCorpus(tokens, targets, offsets, fingerprint, skipped, parts=parts, degenerate_pairs=degenerate[0],
                            degenerate_examples=degenerate[1])


def encode_source(source: str, settings: ChatSettings) -> ChatCorpus:
    """A source encoded in this process, held in memory (for small sets; large ones are prepared once)."""
    encoder = settings.encoder()
    arrays = _Arrays(None, _token_dtype(encoder.tokenizer))
    for chunk in _chunks(source):
        arrays.add(encode_rows(encoder, chunk, settings.skip_invalid))
    _check_some(arrays, source, settings.kind)
    tokens, targets = (np.concatenate(p) for p in arrays.held)
    template = "" if encoder.template is None else encoder.template.hash
    # a chat corpus's fingerprint as before pairs existed: a run resumed on the same data still matches
    kind = "" if settings.kind == "chat" else f"/{settings.kind}"
    made = f"{source_fingerprint(source)}/{encoder.tokenizer.fingerprint}/{template}{kind}"
    fingerprint = hashlib.blake2b(made.encode(), digest_size=8).hexdigest()
    return _corpus(settings.kind, tokens, targets.astype(bool), arrays.offsets(), fingerprint, arrays.skipped,
                   arrays.parts(), (arrays.degenerate, arrays.degenerate_examples))


def is_prepared(source: str) -> bool:
    return (Path(source).expanduser() / MANIFEST).is_file()


def prepare(source: str, settings: ChatSettings, out: str, workers: int = 0, progress: bool = True) -> dict:
    """Encode `source` into the prepared folder `out` (the module docstring); returns the manifest."""
    encoder = settings.encoder()
    chat_files(source)  # a missing or unreadable source is said before any worker starts
    out_path = Path(out).expanduser()
    if out_path.is_file() or (out_path.is_dir() and any(out_path.iterdir())):
        raise DataError(f"--out: {out_path} exists and is not empty; choose a new folder (prepared data is never "
                        "overwritten)")
    partial = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    token_dtype = _token_dtype(encoder.tokenizer)
    arrays = _Arrays(partial, token_dtype)
    workers = workers or os.cpu_count() or 1
    try:
        with _workers(workers, settings) as pool, _progress_bar(progress, KINDS[settings.kind].unit) as bar:
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
        _check_some(arrays, source, settings.kind)
        np.save(partial / "offsets.npy", arrays.offsets())
        if settings.kind == "preference":
            np.save(partial / "parts.npy", arrays.parts())
        manifest = _manifest(source, settings, encoder, arrays, token_dtype)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out_path.exists():
            out_path.rmdir()
        partial.rename(out_path)
        return manifest
    finally:
        arrays.close()
        shutil.rmtree(partial, ignore_errors=True)


@contextmanager
def _workers(count: int, settings: ChatSettings):
    """A pool of `count` spawned workers that import `mop.data.prepared` alone. A spawned process
    first imports the parent's main module (`mop`'s command line, which imports torch: seconds and
    about 200 MB per worker); the main module is hidden while the workers start, which they do in
    `Pool()`, since they need nothing of it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        pool = multiprocessing.get_context("spawn").Pool(count, _start_worker, (settings,))
    finally:
        sys.modules["__main__"] = main
    with pool:
        yield pool


def _progress_bar(enabled: bool, unit: str):
    from tqdm import tqdm

    return tqdm(unit=f" {unit}s", disable=not enabled, smoothing=0.1)


def _manifest(source, settings: ChatSettings, encoder, arrays: _Arrays, token_dtype) -> dict:
    template = encoder.template
    return {"format": KINDS[settings.kind].format, "version": VERSION, "targets_version": TARGETS_VERSION,
            "source": str(source), "source_fingerprint": source_fingerprint(source),
            "tokenizer": encoder.tokenizer.name, "tokenizer_fingerprint": encoder.tokenizer.fingerprint,
            "template_origin": template and template.origin, "template_sha256": template and template.hash,
            "token_dtype": token_dtype.str, **KINDS[settings.kind].counts(arrays), "skipped": arrays.skipped,
            "skipped_examples": arrays.examples}


def add_arguments(parser) -> None:
    """`mop data prepare`'s arguments."""
    parser.add_argument("source", help="conversations (or preference pairs): a .jsonl/.parquet file, a folder of them "
                        "or a datasets folder")
    parser.add_argument("--format", choices=tuple(KINDS), default="chat", help="what the rows hold: conversations, or "
                        "preference pairs (prompt, chosen, rejected; data.format)")
    parser.add_argument("--tokenizer", required=True, help="the model's Hugging Face tokenizer folder (with its chat "
                        "template); training uses the same one as data.tokenizer")
    parser.add_argument("--out", required=True, help="the prepared folder to write (new or empty)")
    parser.add_argument("--chat-template", default="", help="a Jinja template file instead of the tokenizer folder's "
                        "(training then sets the same file as data.chat_template)")
    parser.add_argument("--skip-invalid", action="store_true", help="count and skip unusable rows instead of "
                        "stopping at the first (data.skip_invalid)")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (0: one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> None:
    """`mop data prepare`: prepare, then say what was written and how fast."""
    import time

    start = time.perf_counter()
    settings = ChatSettings(args.tokenizer, args.chat_template, args.skip_invalid, args.format)
    m = prepare(args.source, settings, args.out, args.workers, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    print(f"mop: prepared {KINDS[args.format].said(m)}{m['targets']} targets, {m['skipped']} skipped) in {args.out} "
          f"in {seconds:.1f} s ({m['tokens'] / seconds:.0f} tokens/s); train on it with --data.format={args.format} "
          f"--data.source={args.out} --data.tokenizer={args.tokenizer}")


def open_prepared(source: str, settings: ChatSettings) -> ChatCorpus:
    """A prepared folder's arrays, memory-mapped, after checking it was made for this run's data.format,
    tokenizer and template."""
    folder = Path(source).expanduser()
    manifest = _read_manifest(folder)
    kind = _kind_of(manifest, folder)
    if kind != settings.kind:
        raise other_format(folder, kind)
    made = manifest.get("targets_version", 1)
    if made != TARGETS_VERSION:
        changes = "; ".join(TARGETS_CHANGES[v] for v in range(made + 1, TARGETS_VERSION + 1))
        raise DataError(f"data.source: {folder} was prepared with mop's earlier assistant targets (version {made}, now "
                        f"{TARGETS_VERSION}: {changes}); prepare it again with mop data prepare")
    encoder = settings.encoder()
    mine = {"tokenizer_fingerprint": ("tokenizer", encoder.tokenizer.fingerprint, "data.tokenizer"),
            "template_sha256": ("chat template", encoder.template and encoder.template.hash, "data.chat_template")}
    for key, (what, value, setting) in mine.items():
        if manifest.get(key) != value:
            raise DataError(f"data.source: {folder} was prepared with another {what} than this run's {setting} "
                            f"({manifest.get(key)!r} there, {value!r} here); set {setting} to the one it was prepared "
                            "with, or prepare the source again")
    dtype = np.dtype(manifest["token_dtype"])
    offsets = _load(folder / "offsets.npy")
    parts = _load(folder / "parts.npy") if kind == "preference" else None
    tokens, targets = (_memmap(folder / name, t) for name, t in (("tokens.bin", dtype), ("targets.bin", np.uint8)))
    items = len(offsets) - 1
    if len(tokens) != offsets[-1] or len(targets) != offsets[-1] or (parts is not None and len(parts) != items):
        raise DataError(f"data.source: {folder}'s arrays disagree with its offsets (truncated copy?); prepare it again")
    fingerprint = hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=8).hexdigest()
    if "degenerate_pairs" in manifest:
        degenerate = (manifest["degenerate_pairs"], manifest["degenerate_examples"])
    else:  # a chat folder, or pairs prepared before they were counted
        degenerate = (0 if parts is None else sum(same_responses(tokens[a:b], p) for a, b, p in
                                                  zip(offsets[:-1], offsets[1:], parts)), [])
    return _corpus(kind, tokens, targets, np.asarray(offsets), fingerprint, manifest["skipped"], parts, degenerate)


def _read_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"data.source: {folder / MANIFEST} is not valid JSON ({e}); prepare the folder again") from None


def _kind_of(manifest: dict, folder: Path) -> str:
    """The kind of rows a prepared folder holds, refusing a folder of another format or version."""
    kind = next((name for name, k in KINDS.items() if k.format == manifest.get("format")), None)
    if kind is None or manifest.get("version") != VERSION:
        raise DataError(f"data.source: {folder} is not a prepared folder of this mop (format "
                        f"{manifest.get('format')!r} version {manifest.get('version')!r}); prepare it again with "
                        "mop data prepare")
    return kind


def prepared_kind(source: str) -> str:
    """"chat" or "preference": what a prepared folder holds (refused when neither)."""
    folder = Path(source).expanduser()
    return _kind_of(_read_manifest(folder), folder)


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


def load_corpus(source: str, settings: ChatSettings) -> ChatCorpus:
    """The corpus of a chat or preference source: a prepared folder memory-mapped, anything else encoded now."""
    return open_prepared(source, settings) if is_prepared(source) else encode_source(source, settings)
