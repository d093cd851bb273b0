"""The kinds of rows a prepared folder holds, one per format package that prepares its rows (`KINDS`:
chat, preference), picked by data.format or by a folder's manifest: a source's corpus (`load_corpus`),
encoded now (`encode_source`) or memory-mapped from a prepared folder (`open_prepared`), and
`mop data prepare`'s command line. What a kind is, and the folders themselves: `mop.data.prepared`,
which sits below the format packages; this module sits above them.
"""

from __future__ import annotations

from pathlib import Path

from mop.data import prepared
from mop.data.chat.corpus import CHAT
from mop.data.errors import DataError
from mop.data.preference.corpus import PREFERENCE
from mop.data.prepared import VERSION, ChatSettings, Corpus, is_prepared, other_format, read_manifest

KINDS = {"chat": CHAT, "preference": PREFERENCE}


def encode_source(source: str, settings: ChatSettings) -> Corpus:
    """A source encoded in this process, held in memory (for small sets; large ones are prepared once)."""
    return prepared.encode(source, settings, KINDS[settings.kind])


def prepare(source: str, settings: ChatSettings, out: str, workers: int = 0, progress: bool = True) -> dict:
    """Encode `source` into the prepared folder `out` (`mop.data.prepared`); returns the manifest."""
    return prepared.write(source, settings, KINDS[settings.kind], out, workers, progress)


def open_prepared(source: str, settings: ChatSettings) -> Corpus:
    """A prepared folder's arrays, memory-mapped, after checking it was made for this run's data.format,
    tokenizer and template."""
    folder = Path(source).expanduser()
    manifest = read_manifest(folder)
    kind = _kind_of(manifest, folder)
    if kind != settings.kind:
        raise other_format(folder, kind)
    return prepared.read(folder, manifest, settings, KINDS[kind])


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
    return _kind_of(read_manifest(folder), folder)


def load_corpus(source: str, settings: ChatSettings) -> Corpus:
    """The corpus of a chat or preference source: a prepared folder memory-mapped, anything else encoded now."""
    return open_prepared(source, settings) if is_prepared(source) else encode_source(source, settings)


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
