"""The Hugging Face workflow keeps its tokenizer: `from-hf` -> `mop train` (fine-tune) -> `to-hf`
gives a directory transformers loads with the fine-tuned model's logits (1e-5, fp32) and a
tokenizer that encodes text exactly as the original; checkpoints record their tokenizer and a
resume with another one is a one-line error unless allowed."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from mop import checkpoint
from mop.cli import main
from mop.data import ByteTokenizer
from mop.metrics import read_metrics
from test_data import SAMPLE, _train_bpe
from test_hf import check_routing_is_unambiguous, hf_model, randomize
from test_train import REFERENCE_LAYOUT, TINY
from test_checkpoint import MOP_W2

transformers = pytest.importorskip("transformers")

# What a fine-tune of the imported model sets (its [model] and [data] come from model.toml).
RUN = ["--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--optim.warmup_steps=0",
       "--optim.lr=1e-3", "--log.progress=false", "--log.tensorboard=false", "--log.plot=false"]
TEXTS = [SAMPLE, "the quick brown fox jumps over the lazy dog", "  two  spaces,\ttab\nnewline", "",
         "chat <|im_start|>user hi<|im_end|> and <|endoftext|> inside text", "Ünïcödé 🙂🙂 — ½ ∑ 日本"]


def load_model(path, meta: dict | None = None):
    """The whole model of checkpoint `path` in one process, in fp32, without optimizer state."""
    from mop.models.config import ModelConfig
    from mop.models.hf import empty_model

    meta = meta or checkpoint.read_meta(path)
    model = empty_model(ModelConfig(**meta["config"]["model"]), torch.float32)
    checkpoint.load(path, model, None, checkpoint.GlobalViews(model, None), meta=meta)
    return model


def test_to_hf_reads_one_output_files_tensors_at_a_time(tmp_path, monkeypatch):
    """`mop convert to-hf` never holds the model: each request to the checkpoint is the parameters
    of one output file, and the files written equal the in-memory `save_hf` of the whole model."""
    from safetensors.torch import load_file

    from mop.convert import export
    from mop.models.hf import save_hf

    assert main(["train", *TINY, f"--log.run_dir={tmp_path / 'run'}", "--checkpoint.every=5"]) == 0
    step = tmp_path / "run" / "checkpoints" / "step_5"
    requests = []
    read = checkpoint.read_tensors
    monkeypatch.setattr(checkpoint, "read_tensors", lambda *a: requests.append(sorted(a[2])) or read(*a))
    export(step, tmp_path / "streamed", None, "float32", max_shard_bytes=40_000)
    files = sorted((tmp_path / "streamed").glob("model-*.safetensors"))
    whole_model = load_model(step)
    sizes = {name: tensor.numel() for name, tensor in whole_model.state_dict().items()}
    assert len(requests) == len(files) > 3
    # a file reads whole parameters: at most a layer's stacked experts beside its own tensors
    assert max(sum(sizes[name] for name in names) for names in requests) < sum(sizes.values()) / 2
    save_hf(whole_model, tmp_path / "whole", max_shard_bytes=40_000)
    for file in files:
        streamed, whole = load_file(file), load_file(tmp_path / "whole" / file.name)
        assert streamed.keys() == whole.keys()
        for k in streamed:
            torch.testing.assert_close(streamed[k], whole[k], atol=0, rtol=0, msg=k)


def hf_config():
    """A tiny qwen3_moe: a dense first layer, GQA, renormalised top-2 of 4 experts; vocabulary
    larger than the tokenizer's (as real models pad theirs)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=352, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0])


def write_corpus(path):
    paragraphs = [SAMPLE, "the quick brown fox jumps over the lazy dog " * 3, "Hello, world! the lazy dog. " * 4]
    path.write_text("\n\n".join(paragraphs * 8))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A HF model directory as the hub has them: weights, config.json, a tokenizer whose eos
    (<|im_end|>) is named by tokenizer_config.json and is not its first special token."""
    base = tmp_path_factory.mktemp("hf")
    model = transformers.AutoModelForCausalLM.from_config(hf_config(), attn_implementation="eager")
    randomize(model, 0, ".mlp.gate.weight")
    model.save_pretrained(base / "model")
    raw = Tokenizer.from_file(str(_train_bpe(base / "raw.json", special=("<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"))))
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>",
                                         pad_token="<|endoftext|>").save_pretrained(base / "model")
    return base / "model"


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("import") / "ckpt"
    assert main(["convert", "from-hf", str(hf_dir), str(path)]) == 0
    return path


def fine_tune(imported, run_dir, corpus, *extra):
    assert main(["train", str(imported / "model.toml"), *REFERENCE_LAYOUT, *RUN, f"--data.source={corpus}",
                 f"--log.run_dir={run_dir}", f"--checkpoint.resume={imported}", *extra]) == 0
    return run_dir / "checkpoints" / f"step_{read_metrics(run_dir / 'metrics.jsonl')[-1]['step']}"


def encodings(tokenizer):
    """The ids of TEXTS, from a transformers tokenizer or (by its tokenizer.json) a `tokenizers` one."""
    if isinstance(tokenizer, str):
        return [e.ids for e in Tokenizer.from_file(tokenizer).encode_batch(TEXTS, add_special_tokens=False)]
    return [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]


@pytest.mark.parametrize("layout", ["reference", pytest.param("mop2", marks=pytest.mark.slow)])
def test_from_hf_fine_tune_to_hf_keeps_the_model_and_its_tokenizer(hf_dir, imported, tmp_path, layout):
    toml = (imported / "model.toml").read_text()
    assert f'[data]\ntokenizer = "{(imported / "tokenizer").resolve()}"' in toml
    corpus = write_corpus(tmp_path / "corpus.txt")
    step = fine_tune(imported, tmp_path / "run", corpus, "--train.steps=2",
                     *(MOP_W2 if layout == "mop2" else []))
    out = tmp_path / "exported"
    assert main(["convert", "to-hf", str(step), str(out)]) == 0

    # The model: transformers' logits are those of mop's model loaded from the fine-tuned checkpoint.
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    assert hf.dtype == torch.float32  # the run trained in float32
    input_ids = torch.randint(0, 343, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_hf = hf(input_ids, output_router_logits=True)
        torch.testing.assert_close(load_model(step)(input_ids), out_hf.logits, atol=1e-5, rtol=1e-5)
        assert (out_hf.logits - original(input_ids).logits).abs().max() > 1e-3  # the fine-tune changed it
    check_routing_is_unambiguous(out_hf.router_logits, 2)

    # The tokenizer: the same files, the same encodings, the same special tokens and ids.
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert encodings(str(out / "tokenizer.json")) == encodings(str(hf_dir / "tokenizer.json"))
    ours, theirs = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert encodings(ours) == encodings(theirs)
    assert (ours.eos_token, ours.pad_token) == (theirs.eos_token, theirs.pad_token) == ("<|im_end|>", "<|endoftext|>")
    eos, pad = theirs.eos_token_id, theirs.pad_token_id
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == hf.config.eos_token_id == eos and "pad_token_id" not in config
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (eos, pad)


def test_to_hf_writes_the_dtype_trained_in_and_the_byte_tokenizer(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--train.dtype=bfloat16", f"--log.run_dir={run_dir}"]) == 0
    step = run_dir / "checkpoints/step_1"
    for args, dtype in (([], torch.bfloat16), (["--dtype=float32"], torch.float32)):
        out = tmp_path / f"hf_{dtype}"
        assert main(["convert", "to-hf", str(step), str(out), *args]) == 0
        assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        with safe_open(out / "model.safetensors", "pt") as weights:
            assert {weights.get_tensor(key).dtype for key in weights.keys()} == {dtype}
    byte = ByteTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    plain = [text for text in TEXTS if "<|" not in text] + ["\x00\x7f\x80 \u0085\u00ff\ufffd"]
    assert [hf.encode(t, add_special_tokens=False) for t in plain] == [raw.encode(t).ids for t in plain] == [
        byte.encode(t) for t in plain]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def test_resuming_with_another_tokenizer_is_one_line_unless_allowed(imported, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = ["train", str(imported / "model.toml"), *REFERENCE_LAYOUT, *RUN, "--train.steps=1",
            f"--data.source={corpus}", f"--checkpoint.resume={imported}", "--data.tokenizer=byte"]
    capsys.readouterr()
    assert main([*args, f"--log.run_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: data.tokenizer: checkpoint {imported} was trained with the tokenizer ")
    assert f"--data.tokenizer={imported / 'tokenizer'}" in err and "allow_tokenizer_change" in err and "\n" not in err
    assert main([*args, "--checkpoint.allow_tokenizer_change=true", f"--log.run_dir={tmp_path / 'b'}"]) == 0


def test_a_checkpoint_saved_before_tokenizers_were_recorded_resumes_and_exports(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=2", f"--log.run_dir={run_dir}"]) == 0
    step = run_dir / "checkpoints/step_2"
    meta = checkpoint.read_meta(step)
    assert meta["tokenizer"]["kind"] == "byte" and (step / "tokenizer/tokenizer.json").is_file()
    del meta["tokenizer"]
    (step / checkpoint.META).write_text(json.dumps(meta))
    shutil.rmtree(step / "tokenizer")
    assert main(["train", *TINY, "--train.steps=3", f"--log.run_dir={tmp_path / 'b'}",
                 f"--checkpoint.resume={step}"]) == 0
    capsys.readouterr()
    assert main(["convert", "to-hf", str(step), str(tmp_path / "hf")]) == 0
    assert "does not record its tokenizer" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_a_bare_tokenizer_json_is_carried_with_its_special_tokens(tmp_path):
    """A tokenizer.json alone (eos by its conventional name): the checkpoint's copy gets a
    tokenizer_config.json naming it, resumes as the same tokenizer, and exports for transformers."""
    path = _train_bpe(tmp_path / "tokenizer.json")
    args = ["train", *TINY, f"--data.tokenizer={path}", "--model.vocab_size=384"]
    assert main([*args, "--train.steps=1", f"--log.run_dir={tmp_path / 'a'}"]) == 0
    step = tmp_path / "a/checkpoints/step_1"
    assert main([*args, "--train.steps=2", f"--log.run_dir={tmp_path / 'b'}", f"--data.tokenizer={step / 'tokenizer'}",
                 f"--checkpoint.resume={step}"]) == 0
    assert main(["convert", "to-hf", str(step), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token) == ("<|endoftext|>", 0, None)
    assert encodings(hf) == encodings(str(path))
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["eos_token_id"] == 0 and "bos_token_id" not in config


def test_from_hf_needs_a_tokenizer_that_fits(hf_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    (bare / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main(["convert", "from-hf", str(bare), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: {bare}: no tokenizer.json") and "--tokenizer" in err and "\n" not in err
    assert not (tmp_path / "a").exists()
    (bare / "tiktoken.model").write_text("")  # Kimi-K2's folder: a tiktoken tokenizer, no tokenizer.json
    assert main(["convert", "from-hf", str(bare), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tiktoken" in err and "save_pretrained" in err and "\n" not in err
    assert main(["convert", "from-hf", str(bare), str(tmp_path / "b"), "--tokenizer=byte"]) == 0
    assert '[data]\ntokenizer = "byte"' in (tmp_path / "b/model.toml").read_text()
    assert checkpoint.read_meta(tmp_path / "b")["tokenizer"]["kind"] == "byte"

    small = tmp_path / "small"  # a vocabulary of 128 ids, the tokenizer's has 343
    hf_model("qwen3_moe").save_pretrained(small)
    shutil.copy(hf_dir / "tokenizer.json", small)
    capsys.readouterr()
    assert main(["convert", "from-hf", str(small), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: the tokenizer ") and "has vocab_size=128" in err and "--tokenizer" in err
    assert "\n" not in err
