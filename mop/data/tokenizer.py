"""Tokenizers: a built-in byte-level one and a wrapper around a local HF ``tokenizer.json``.

Both expose the same small interface, which is all the rest of the stack relies on:

- ``encode(text) -> list[int]``: no special tokens are added (packing appends eos itself);
- ``encode_batch(texts) -> list[list[int]]``: the same, for many documents at once;
- ``decode(ids, special=False) -> str``: special tokens are dropped (written with ``special=True``),
  invalid UTF-8 becomes U+FFFD;
- ``vocab_size`` (one more than the largest id), ``eos_id``, ``bos_id`` (None for an HF
  tokenizer without one), ``pad_id`` and ``name`` (what ``data.tokenizer`` was set to);
- ``kind`` ("byte" or "hf") and ``fingerprint`` ("byte", or the sha256 of the ``tokenizer.json``
  bytes): equal fingerprints mean every id stands for the same token, which is what a checkpoint
  checks on resume (``describe`` is the record it keeps, ``mop.checkpoint.check_tokenizer``);
- ``hf_files()``: the files of a Hugging Face directory that loads the same tokenizer, which
  checkpoints carry and ``mop convert to-hf`` writes.

``ByteTokenizer`` needs no files: ids 0-255 are raw UTF-8 bytes, then ``<|bos|>`` = 256,
``<|eos|>`` = 257, ``<|pad|>`` = 258. Its Hugging Face equivalent is a byte-level BPE without
merges, so each byte is one token of the same id; it encodes every text as ``ByteTokenizer``
does, except that, like every HF tokenizer, it reads the literal text of a special token
(``"<|eos|>"``) as that token. ``HFTokenizer`` takes its eos token from an explicit
``eos_token`` argument, else from ``tokenizer_config.json`` next to the file, else from the
first of a few conventional names present in the vocabulary; without one, documents could not
be separated, so that is an error. Nothing is ever downloaded.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as _HFTokenizerImpl

from mop.data.errors import DataError

# Document separators first: tokenizers that also have chat-turn markers (Qwen's <|im_end|>,
# Llama 3's <|eot_id|>) were pretrained with the end-of-text token between documents.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
# What a Hugging Face directory holds of a fast tokenizer besides tokenizer.json: the special
# tokens, the tokenizer class and the chat template (transformers 5 keeps it in its own file).
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# The named special tokens transformers passes to a chat template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus bos/eos/pad; lossless for any text."""

    name = "byte"
    kind = "byte"
    fingerprint = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    SPECIAL = {"<|bos|>": bos_id, "<|eos|>": eos_id, "<|pad|>": pad_id}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids, special: bool = False) -> str:
        """The text of `ids`; the special tokens dropped, or with `special` written as their names."""
        names = {i: token.encode() for token, i in self.SPECIAL.items()} if special else {}
        return b"".join(bytes([i]) if i < 256 else names.get(i, b"") for i in map(int, ids)).decode("utf-8", "replace")

    def hf_files(self) -> dict[str, bytes]:
        """The Hugging Face equivalent (module docstring): a byte-level BPE without merges whose
        vocabulary maps GPT-2's printable stand-in of byte b to id b, written as JSON directly so
        that it is the same whatever ``tokenizers`` version is installed."""
        stand_in = _byte_stand_ins()
        byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for token, i in self.SPECIAL.items()],
            "normalizer": None,
            # No regex split: the whole text is one piece, every byte of it one token.
            "pre_tokenizer": {"type": "ByteLevel", **byte_level},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", **byte_level},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {stand_in[b]: b for b in range(256)}, "merges": []},
        }
        return {"tokenizer.json": _json_bytes(tokenizer),
                "tokenizer_config.json": _tokenizer_config("<|eos|>", "<|bos|>", "<|pad|>")}


def _byte_stand_ins() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ``ByteLevel`` pre-tokenizer:
    printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _tokenizer_config(eos: str, bos: str | None, pad: str | None) -> bytes:
    """A ``tokenizer_config.json`` that makes transformers load ``tokenizer.json`` as it is (no
    model-specific class that could rebuild its pipeline) with these special tokens."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "eos_token": eos,
              **({"bos_token": bos} if bos is not None else {}), **({"pad_token": pad} if pad is not None else {})}
    return _json_bytes(config)


def _token_content(entry) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an AddedToken dict.
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _plain(tok: _HFTokenizerImpl) -> _HFTokenizerImpl:
    """A tokenizer that neither truncates nor pads (a tokenizer.json may set either; transformers
    turns them off for every call that does not ask for them, and a document is never cut here)."""
    tok.no_truncation()
    tok.no_padding()
    return tok


class HFTokenizer:
    """A local ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    kind = "hf"

    def __init__(self, path: str | Path, eos_token: str | None = None):
        path = Path(path)
        try:
            # Read once: the bytes fingerprinted are the bytes loaded and the bytes checkpoints carry.
            self._json = path.read_bytes()
            self._tok = _plain(_HFTokenizerImpl.from_str(self._json.decode("utf-8")))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(
                f"data.tokenizer: cannot load {path} ({str(e).splitlines()[0]}); point "
                "data.tokenizer at a valid HF tokenizer.json or use 'byte'"
            ) from None
        self.name = str(path)
        self.fingerprint = hashlib.sha256(self._json).hexdigest()
        self._companions = {name: (path.parent / name).read_bytes() for name in COMPANION_FILES
                            if (path.parent / name).is_file()}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Added tokens may sit above the base vocabulary with gaps, so count by the largest id.
        self.vocab_size = max(vocab.values()) + 1
        config = self._parse_config(path.parent / "tokenizer_config.json")
        self.directory = path.parent
        self._special_tokens_map = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES
                                    if _token_content(config.get(name)) is not None}

        eos_token = eos_token or _token_content(config.get("eos_token"))
        if eos_token is not None:
            if eos_token not in vocab:
                raise DataError(
                    f"data.eos_token: {eos_token!r} is not in the vocabulary of {path}; set --data.eos_token "
                    "to the document separator this tokenizer defines (mop convert from-hf: --eos-token)"
                )
            self.eos_id = vocab[eos_token]
        else:
            found = [t for t in EOS_CANDIDATES if t in vocab]
            if not found:
                raise DataError(
                    f"data.tokenizer: {path} has none of the end-of-text tokens "
                    f"{', '.join(EOS_CANDIDATES)}; set --data.eos_token to its document separator "
                    "(mop convert from-hf: --eos-token)"
                )
            self.eos_id = vocab[found[0]]
        self.bos_id = self._special(vocab, config.get("bos_token"), BOS_CANDIDATES)
        # Padding positions are masked out of the loss, so eos is a safe stand-in pad.
        pad = self._special(vocab, config.get("pad_token"), PAD_CANDIDATES)
        self.pad_id = self.eos_id if pad is None else pad

    def _parse_config(self, path: Path) -> dict:
        """`tokenizer_config.json` from the bytes read with the other companion files (the config
        used is the one checkpoints carry); {} without one."""
        text = self._companions.get(path.name)
        if text is None:
            return {}
        try:
            config = json.loads(text.decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError is a ValueError
            raise DataError(f"data.tokenizer: cannot read {path} ({e}); fix or remove it") from None
        return config if isinstance(config, dict) else {}

    @staticmethod
    def _special(vocab: dict, configured, candidates) -> int | None:
        configured = _token_content(configured)
        if configured in vocab:
            return vocab[configured]
        return next((vocab[t] for t in candidates if t in vocab), None)

    def hf_files(self) -> dict[str, bytes]:
        """``tokenizer.json`` and the companion files beside it, as read at load; when there is
        no ``tokenizer_config.json``, one naming the special tokens in use (transformers needs it
        to load the tokenizer as it is, see ``_tokenizer_config``)."""
        files = {"tokenizer.json": self._json, **self._companions}
        if "tokenizer_config.json" not in files:
            bos, pad = (None if i is None else self._tok.id_to_token(i) for i in (self.bos_id, self.pad_id))
            files["tokenizer_config.json"] = _tokenizer_config(self._tok.id_to_token(self.eos_id), bos, pad)
        return files

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not special)

    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens of ``tokenizer_config.json`` (``eos_token``, ...) as a chat
        template sees them (transformers' ``special_tokens_map``)."""
        return dict(self._special_tokens_map)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``text`` (as ``encode``) and each token's ``[start, end)`` characters, int64
        ``[n, 2]``: the offsets transformers reads when it maps characters to tokens."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int64), np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)


AnyTokenizer = ByteTokenizer | HFTokenizer


def describe(tok: AnyTokenizer) -> dict:
    """What a checkpoint records of the tokenizer it was trained with (``mop.json``'s "tokenizer")."""
    return {"kind": tok.kind, "name": tok.name, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "bos_id": tok.bos_id, "pad_id": tok.pad_id}


def load_tokenizer(spec: str, eos_token: str | None = None) -> AnyTokenizer:
    """``"byte"``, a ``tokenizer.json`` file, or a directory holding one."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json", eos_token)
    if path.is_file():
        return HFTokenizer(path, eos_token)
    raise DataError(
        f"data.tokenizer = {spec!r} is neither 'byte' nor a tokenizer.json file or a directory "
        "containing one; set data.tokenizer to 'byte' or to a local tokenizer.json path"
    )
