"""Tokenizers: a built-in byte-level one and a wrapper around a local HF ``tokenizer.json``.

Both expose the same small interface, which is all the rest of the stack relies on:

- ``encode(text) -> list[int]``: no special tokens are added (packing appends eos itself);
- ``encode_batch(texts) -> list[list[int]]``: the same, for many documents at once;
- ``decode(ids) -> str``: special tokens are dropped, invalid UTF-8 becomes U+FFFD;
- ``vocab_size`` (one more than the largest id), ``eos_id``, ``bos_id`` (None for an HF
  tokenizer without one), ``pad_id`` and ``name`` (what ``data.tokenizer`` was set to).

``ByteTokenizer`` needs no files: ids 0-255 are raw UTF-8 bytes, then ``<|bos|>`` = 256,
``<|eos|>`` = 257, ``<|pad|>`` = 258. ``HFTokenizer`` takes its eos token from an explicit
``eos_token`` argument, else from ``tokenizer_config.json`` next to the file, else from the
first of a few conventional names present in the vocabulary; without one, documents could not
be separated, so that is an error. Nothing is ever downloaded.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizerImpl

from mop.data.errors import DataError

# Document separators first: tokenizers that also have chat-turn markers (Qwen's <|im_end|>,
# Llama 3's <|eot_id|>) were pretrained with the end-of-text token between documents.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus bos/eos/pad; lossless for any text."""

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def _token_content(entry) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an AddedToken dict.
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class HFTokenizer:
    """A local ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        path = Path(path)
        try:
            self._tok = _HFTokenizerImpl.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(
                f"data.tokenizer: cannot load {path} ({str(e).splitlines()[0]}); point "
                "data.tokenizer at a valid HF tokenizer.json or use 'byte'"
            ) from None
        self.name = str(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Added tokens may sit above the base vocabulary with gaps, so count by the largest id.
        self.vocab_size = max(vocab.values()) + 1
        config = self._read_config(path.parent / "tokenizer_config.json")

        eos_token = eos_token or _token_content(config.get("eos_token"))
        if eos_token is not None:
            if eos_token not in vocab:
                raise DataError(
                    f"data.eos_token: {eos_token!r} is not in the vocabulary of {path}; set "
                    "--data.eos_token to the document separator this tokenizer defines"
                )
            self.eos_id = vocab[eos_token]
        else:
            found = [t for t in EOS_CANDIDATES if t in vocab]
            if not found:
                raise DataError(
                    f"data.tokenizer: {path} has none of the end-of-text tokens "
                    f"{', '.join(EOS_CANDIDATES)}; set --data.eos_token to its document separator"
                )
            self.eos_id = vocab[found[0]]
        self.bos_id = self._special(vocab, config.get("bos_token"), BOS_CANDIDATES)
        # Padding positions are masked out of the loss, so eos is a safe stand-in pad.
        pad = self._special(vocab, config.get("pad_token"), PAD_CANDIDATES)
        self.pad_id = self.eos_id if pad is None else pad

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"data.tokenizer: cannot read {path} ({e}); fix or remove it") from None
        return config if isinstance(config, dict) else {}

    @staticmethod
    def _special(vocab: dict, configured, candidates) -> int | None:
        configured = _token_content(configured)
        if configured in vocab:
            return vocab[configured]
        return next((vocab[t] for t in candidates if t in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


AnyTokenizer = ByteTokenizer | HFTokenizer


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
