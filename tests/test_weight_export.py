"""The trainer's weights exported for an inference engine (issue 48, `mop.rl.weights`): from the mop
layout on 4 ranks (FSDP2 over the world, experts over 2 ranks with LLEP, the vocabulary ring,
Ulysses), after a training step, the buckets written as a Hugging Face folder load in transformers,
and its fp32 log-probs of a batch equal the trainer's own policy's under its layout; the buckets
keep to their size."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mop.build import build_run
from mop.config import load_config
from mop.parallel import DistLayout, Layout
from mop.rl.weights import sync_unit, weight_buckets, write_folder
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import train_step, update

transformers = pytest.importorskip("transformers")

SEQ = 32
MODEL = {"qwen3_moe": ["--model.family=qwen3_moe", "--model.dense_layers=1", "--model.dense_intermediate=24"],
         "deepseek_v3": ["--model.family=deepseek_v3", "--model.dense_layers=1", "--model.dense_intermediate=24",
                         "--model.kv_heads=8", "--model.head_dim=8", "--model.options.qk_rope_head_dim=4",
                         "--model.options.groups=2", "--model.options.groups_per_token=1", "--model.qk_norm=false"],
         "glm4_moe": ["--model.family=glm4_moe", "--model.dense_layers=1", "--model.dense_intermediate=24",
                      "--model.shared_expert_intermediate=16"],
         "mixtral": ["--model.family=mixtral", "--model.qk_norm=false", "--model.norm_topk_prob=true"],
         "gpt_oss": ["--model.family=gpt_oss", "--model.qk_norm=false", "--model.options.sliding_window=4"]}
COMMON = ["--model.vocab_size=259", "--model.hidden=32", "--model.layers=3", "--model.heads=8", "--model.kv_heads=2",
          "--model.head_dim=4", "--model.experts=4", "--model.top_k=2", "--model.expert_intermediate=16",
          f"--data.seq_len={SEQ}", "--train.global_batch=4", "--train.micro_batch=1", "--optim.lr=0.02",
          "--optim.warmup_steps=0", "--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=2",
          "--parallel.expert=2", "--parallel.vocab=2", "--parallel.expert_balance=llep", "--train.dtype=float32"]
BUCKET = 16 * 1024


def stepped_run(rank: int, world: int, overrides: list[str]):
    """This rank's run of `overrides` after one training step."""
    config = settle(load_config(None, overrides), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    train_step(run, run.next_batches())
    update(run)
    return run


def sequence_0(run) -> dict:
    """The trainer's log-probs of data group 0's first sequence (ranks 0 and 1 hold its two slices)."""
    batch = run.rank_batches([0, 1], run.data.dataset)[0]
    with torch.no_grad():
        terms = run.model.policy_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                       batch["document_ids"])
    return {"logps": terms.logps, "input_ids": batch["input_ids"], "labels": batch["labels"],
            "document_ids": batch["document_ids"]}


def check_transformers_log_probs(folder, ranks: list[dict]) -> None:
    """transformers on `folder` gives the trainer's log-probs of sequence 0 (`sequence_0` of ranks 0, 1)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    ids = torch.cat([ranks[0]["input_ids"], ranks[1]["input_ids"]], 1)
    labels = torch.cat([ranks[0]["labels"], ranks[1]["labels"]], 1)
    logps = torch.cat([ranks[0]["logps"], ranks[1]["logps"]], 1)
    documents = torch.cat([ranks[0]["document_ids"], ranks[1]["document_ids"]], 1)
    kept = labels != -100
    for document in documents.unique():  # transformers sees one document at a time: no packing there
        at = documents[0] == document
        with torch.no_grad():
            logits = model(ids[:, at]).logits.float()
        theirs = logits.log_softmax(-1).gather(-1, labels[:, at].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        assert_close(theirs[kept[:, at]], logps[:, at][kept[:, at]], rtol=1e-5, atol=1e-5)


def export_after_a_step(rank: int, world: int, overrides: list[str], folder: str) -> dict:
    run = stepped_run(rank, world, overrides)
    sizes = []

    def measured(buckets):
        for bucket in buckets:
            sizes.append((sum(t.nbytes for _, t in bucket), sorted({sync_unit(key) for key, _ in bucket})))
            yield bucket

    write_folder(measured(weight_buckets(run, BUCKET, torch.float32)), run, folder, torch.float32)
    return {**sequence_0(run), "sizes": sizes}


@pytest.mark.parametrize("family", [f if f in ("qwen3_moe", "deepseek_v3") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(MODEL)])
def test_exported_weights_load_in_transformers_and_give_the_trainers_log_probs(tmp_path, family):
    folder = tmp_path / "export"
    ranks = run_distributed(export_after_a_step, 4, [*COMMON, *MODEL[family]], str(folder))
    sizes = ranks[0]["sizes"]
    assert len(sizes) > 3 and all(not r["sizes"] for r in ranks[1:])
    # over its size only as one unit's own (a tensor, or a layer's attention), and no unit split
    assert all(size <= BUCKET or len(units) == 1 for size, units in sizes)
    units = [unit for _, bucket_units in sizes for unit in bucket_units]
    assert len(units) == len(set(units)) and any(unit.endswith(".self_attn") for unit in units)
    check_transformers_log_probs(folder, ranks)


def export_published(rank: int, world: int, imported: str, overrides: list[str], published: str, plain: str,
                     sent: str) -> None:
    """After a step from the imported published base: the weights in fp32 (`plain`), and as the base
    publishes them (`sent`)."""
    from pathlib import Path

    from mop.models.hf import AsPublished, HFWeights
    from mop.train import start_from

    config = settle(load_config(f"{imported}/model.toml", overrides), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    start_from(run, Path(imported))
    train_step(run, run.next_batches())
    update(run)
    write_folder(weight_buckets(run, BUCKET, torch.float32), run, plain, torch.float32)
    write_folder(weight_buckets(run, BUCKET, torch.bfloat16), run, f"{plain}-bf16", torch.bfloat16)
    with HFWeights(Path(published)) as base:
        form = AsPublished(base)
    write_folder(weight_buckets(run, BUCKET, torch.bfloat16, form), run, sent, torch.bfloat16, form)


def folder_tensors(folder) -> dict:
    from safetensors.torch import load_file

    return {key: value for file in sorted(folder.glob("*.safetensors")) for key, value in load_file(file).items()}


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_a_published_base_is_sent_as_its_publisher_quantizes_the_trainers_weights(tmp_path, family):
    """DeepSeek-V3's fp8 blocks and gpt-oss's MXFP4 experts: from the mop layout on 2 ranks after a step
    from the imported published checkpoint, every tensor sent equals, bit for bit, what the tests' own
    quantizers (the ones the published base was made with) make of the trainer's fp32 weights, under
    the same names; the others in the base's dtype; and mop reads the folder as a published base."""
    import json
    import shutil

    import test_deepseek_v3
    import test_gpt_oss
    from safetensors.torch import save_file
    from test_lora import published_pair

    from mop.cli import main
    from mop.models.hf import HFWeights

    published, _ = published_pair(tmp_path, family)
    assert main(["convert", "from-hf", str(published), str(tmp_path / "import"), "--tokenizer", "byte"]) == 0
    layout = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=1", "--parallel.expert=2",
              "--parallel.vocab=2", "--parallel.expert_balance=llep", "--train.dtype=float32", "--optim.offload=true",
              "--data.seq_len=32", "--train.global_batch=2", "--train.micro_batch=1", "--optim.lr=0.01",
              "--optim.warmup_steps=0"]
    plain, sent = tmp_path / "plain", tmp_path / "sent"
    run_distributed(export_published, 2, str(tmp_path / "import"), layout, str(published), str(plain), str(sent))
    oracle = tmp_path / "oracle"  # the fp32 weights through the tests' quantizer, as the base was made
    oracle.mkdir()
    shutil.copy(published / "config.json", oracle / "config.json")
    save_file(folder_tensors(plain), oracle / "model.safetensors", metadata={"format": "pt"})
    if family == "deepseek_v3":
        test_deepseek_v3.quantize_fp8(oracle, (16, 8))
    else:
        test_gpt_oss.quantize_mxfp4(oracle)
    expected, got = folder_tensors(oracle), folder_tensors(sent)
    assert sorted(got) == sorted(expected) and any(key.endswith(("_scale_inv", "_blocks")) for key in got)
    for key, value in expected.items():
        assert got[key].dtype.itemsize == value.dtype.itemsize, key
        assert torch.equal(got[key].view(value.dtype), value), key
    config = json.loads((sent / "config.json").read_text())
    assert config["quantization_config"] == json.loads((published / "config.json").read_text())["quantization_config"]
    # the router's score-correction bias goes in fp32 in any export dtype, as published and as the engines hold it
    in_bf16, in_fp32 = folder_tensors(tmp_path / "plain-bf16"), folder_tensors(plain)
    biases = [key for key in in_bf16 if key.endswith("e_score_correction_bias")]
    assert len(biases) == (family == "deepseek_v3") * 2 and all(
        in_bf16[key].dtype == torch.float32 and torch.equal(in_bf16[key], in_fp32[key]) for key in biases)
    with HFWeights(sent) as weights:
        assert weights.quantized.format is not None


def export_lora(rank: int, world: int, overrides: list[str], merged: str, adapters: str, run_dir: str) -> dict:
    from pathlib import Path

    from mop.rl.weights import write_adapters
    from mop.train import save

    run = stepped_run(rank, world, overrides)
    write_folder(weight_buckets(run, BUCKET, torch.float32), run, merged, torch.float32)
    write_adapters(run, adapters, torch.float32)
    return {**sequence_0(run), "saved": str(save(run, Path(run_dir), 1))}


def test_a_lora_run_is_sent_merged_or_as_its_adapters(tmp_path):
    """LoRA over the experts and attention from 4 ranks after a step: the merged weights give
    transformers the trainer's log-probs (adapters on, 1e-5), and the adapters alone are the PEFT files
    the run's checkpoint writes at the same step, bit for bit."""
    from safetensors.torch import load_file

    lora = ["--train.finetune=lora", "--lora.rank=4", "--lora.alpha=8",
            "--lora.targets=attention,dense_mlp,routed_experts"]
    ranks = run_distributed(export_lora, 4, [*COMMON, *MODEL["qwen3_moe"], *lora], str(tmp_path / "merged"),
                            str(tmp_path / "adapters"), str(tmp_path / "run"))
    check_transformers_log_probs(tmp_path / "merged", ranks)
    sent = load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    saved = load_file(f"{ranks[0]['saved']}/peft/adapter_model.safetensors")
    assert sorted(sent) == sorted(saved) and len(sent) > 8
    for key, value in saved.items():
        assert torch.equal(sent[key], value), key
