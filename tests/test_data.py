"""Tokenizers, the shipped corpus and build_data end to end."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mop.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    build_data,
    group_slice,
    iter_documents,
    load_batch,
    load_tokenizer,
    micro_batches,
)

SAMPLE = "Hello, world! Ünïcödé — 日本語 and emoji 🙂.\nSecond line."


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == SAMPLE
    assert tok.encode_batch(["a", "é"]) == [[97], [0xC3, 0xA9]]
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated character is replaced, not an error


def _train_bpe(path, special=("<|endoftext|>",)):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SAMPLE, "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_from_file_and_directory(tmp_path):
    _train_bpe(tmp_path / "tokenizer.json")
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_id == 0  # the only special token, added first by the trainer
        assert tok.pad_id == tok.eos_id and tok.bos_id is None
        ids = tok.encode(SAMPLE)
        assert tok.eos_id not in ids and max(ids) < tok.vocab_size
        assert tok.decode(ids) == SAMPLE
        assert tok.decode([*ids, tok.eos_id]) == SAMPLE
        assert tok.encode_batch([SAMPLE, "fox"]) == [ids, tok.encode("fox")]


def test_hf_tokenizer_eos_sources(tmp_path):
    _train_bpe(tmp_path / "tokenizer.json", special=("<unk>", "</s>", "<|im_end|>"))
    assert load_tokenizer(str(tmp_path)).eos_id == 1  # conventional name found
    assert load_tokenizer(str(tmp_path), eos_token="<|im_end|>").eos_id == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<unk>"}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id) == (2, 0)
    with pytest.raises(DataError, match="not in the vocabulary"):
        load_tokenizer(str(tmp_path), eos_token="<nope>")


def test_hf_tokenizer_without_eos_is_an_error(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json", special=("<unk>",))
    with pytest.raises(DataError, match="set --data.eos_token to its document separator"):
        load_tokenizer(str(path))


def test_bad_tokenizer_spec(tmp_path):
    with pytest.raises(DataError, match="data.tokenizer") as e:
        load_tokenizer(str(tmp_path / "missing.json"))
    assert "\n" not in str(e.value)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="broken.json"):
        load_tokenizer(str(tmp_path / "broken.json"))


def test_builtin_corpus():
    tok = ByteTokenizer()
    docs = list(iter_documents("builtin", tok))
    assert len(docs) > 100
    assert all(tok.eos_id not in d for d in docs)
    text = tok.decode(docs[0])
    assert "\ufffd" not in text and len(text.split()) > 20
    assert sum(map(len, docs)) > 100_000


def test_build_data_end_to_end():
    tok, dataset, stream = build_data("builtin", "byte", seq_len=64, seed=0)
    assert len(dataset) == stream.num_sequences > 1000
    step = stream.batch(3, 8)
    parts = [micro_batches(group_slice(step, g, 2), 2) for g in range(2)]
    batch = load_batch(dataset, parts[1][0])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 64)
    assert batch["document_ids"].dtype == torch.int32
    assert batch["position_ids"].dtype == batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][0], dataset[step[4]]["input_ids"])
    assert np.all(batch["input_ids"].numpy() < tok.vocab_size)
    # Same settings give the same stream identity, so a resume is accepted.
    again = build_data("builtin", "byte", seq_len=64, seed=0).stream
    again.load_state_dict(stream.state_dict())
