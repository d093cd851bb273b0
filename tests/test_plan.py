"""`mop plan` (issue 18): the memory model against measured peaks, the planner's choices against the
trainer's own validation, the command line's output and errors.

Validation against measurement: small configurations on 2 and 4 CPU ranks, covering every knob the
memory model has (D, Ep, P, head chunks, LLEP chunks, activation checkpointing and offload, the host
optimizer or torch AdamW, micro-batches, contexts, the fsdp2 baseline with and without CP and CPU
offload, dense layers and a shared expert). Each is trained for a warm-up step and a memory step by
`mop.testing.step`'s `Trainer` (what `mop bench e2e` runs) and measured by its `step_memory` (the persistent state read from
the tensors plus the step's transient peak from `PeakMemory`, less what lives in host memory on a
GPU machine), worst rank; `mop.cost.memory.estimate` predicts it from the config alone. The
predicted peak must be within 10% of the measured one, and the parameter shards' bytes equal.
LLEP runs with llep_gate = 1 and llep_min_chunk = 1, so that every layer is balanced to its
capacity (the model's assumption for LLEP: a rank computes at most llep_alpha x the mean load).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mop.cli import main
from mop.config import load_config
from mop.cost.cluster import make_cluster
from mop.cost.memory import estimate, parameter_counts
from mop.plan import CONFIGS, load_model, parse_tokens, presets
from mop.plan.search import OBJECTIVES, plan
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.step import Trainer, step_memory

MIB = 2**20
MODEL = ["--model.vocab_size=8192", "--model.hidden=128", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2",
         "--model.head_dim=32", "--model.experts=8", "--model.top_k=2", "--model.expert_intermediate=256"]
COMMON = [*MODEL, "--train.micro_batch=1", "--train.dtype=float32", "--train.device=cpu", "--train.seed=0",
          "--parallel.llep_gate=1.0", "--parallel.llep_min_chunk=1", "--parallel.vocab_token_block=1024",
          "--parallel.vocab_logits=recompute"]
KEEP = "--parallel.vocab_logits=keep"
MOP = ["--parallel.strategy=mop", "--optim.offload=true"]
FSDP2 = ["--parallel.strategy=fsdp2", "--parallel.vocab=1", "--parallel.expert=1"]
AC = "--train.activation_checkpointing=full"
# LoRA over the run's initial weights kept as fp8 in 32x32 blocks (adapters on every kind)
LORA = ["--train.finetune=lora", "--lora.rank=8", "--lora.base_format=fp8:32x32"]
OFFLOAD = "--train.offload_activations=true"

# (name, world, settings); global batch and micro-batch as each says (several micro-batches where
# the data groups x micro_batch divide it more than once).
CASES = [
    ("mop D2 Ep2 P2 ac, 2 seq/micro-batch", 2,
     [*MOP, "--data.seq_len=4096", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=2", "--train.micro_batch=2", AC]),
    ("mop D2 Ep2 P2, 2 micro-batches", 2,
     [*MOP, "--data.seq_len=2048", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=2"]),
    ("mop D2 Ep2 P2 ac+offload llep/4", 2,
     [*MOP, "--data.seq_len=8192", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=1", AC, OFFLOAD, "--parallel.llep_chunks=4"]),
    ("mop D2 Ep2 P2 logits kept, 2 micro-batches", 2,
     [*MOP, "--data.seq_len=2048", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=2", KEEP]),
    ("mop D1 Ep2 P2", 2,
     [*MOP, "--data.seq_len=2048", "--parallel.sequence=1", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=2"]),
    ("mop D2 Ep1 P1 heads/2 ac", 2,
     [*MOP, "--data.seq_len=4096", "--parallel.sequence=2", "--parallel.expert=1", "--parallel.vocab=1",
      "--train.global_batch=1", "--parallel.attention_head_chunks=2", AC]),
    ("mop D2 Ep2 P2 torch AdamW, 2 micro-batches", 2,
     [*MOP[:1], "--optim.offload=false", "--data.seq_len=2048", "--parallel.sequence=2", "--parallel.expert=2",
      "--parallel.vocab=2", "--train.global_batch=2"]),
    ("mop dense layer + shared expert, ac", 2,
     [*MOP, "--data.seq_len=4096", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=1", AC, "--model.dense_layers=1", "--model.shared_expert_intermediate=128",
      "--model.qk_norm=false"]),
    ("fsdp2 plain, 2 micro-batches", 2,
     [*FSDP2, "--data.seq_len=2048", "--parallel.sequence=1", "--train.global_batch=4"]),
    ("fsdp2 plain logits kept", 2,
     [*FSDP2, "--data.seq_len=2048", "--parallel.sequence=1", "--train.global_batch=2", KEEP]),
    ("fsdp2 CP2 ac", 2, [*FSDP2, "--data.seq_len=4096", "--parallel.sequence=2", "--train.global_batch=1", AC]),
    ("fsdp2 cpu offload ac", 2,
     [*FSDP2, "--data.seq_len=2048", "--parallel.sequence=1", "--train.global_batch=2", AC,
      "--parallel.fsdp_cpu_offload=true"]),
    ("mop D4 Ep4 P4 ac+offload", 4,
     [*MOP, "--data.seq_len=8192", "--parallel.sequence=4", "--parallel.expert=4", "--parallel.vocab=4",
      "--train.global_batch=1", AC, OFFLOAD]),
    ("mop D2 Ep4 P2 heads/2 llep/2 ac", 4,
     [*MOP, "--data.seq_len=4096", "--parallel.sequence=2", "--parallel.expert=4", "--parallel.vocab=2",
      "--train.global_batch=2", "--parallel.attention_head_chunks=2", "--parallel.llep_chunks=2", AC]),
    ("mop D4 Ep2 P4 llep/2", 4,
     [*MOP, "--data.seq_len=4096", "--parallel.sequence=4", "--parallel.expert=2", "--parallel.vocab=4",
      "--train.global_batch=1", "--parallel.llep_chunks=2"]),
    ("mop LoRA on an fp8 base D2 Ep2 P2 ac", 2,
     [*MOP, *LORA, "--data.seq_len=4096", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
      "--train.global_batch=1", AC]),
    ("mop LoRA on an fp8 base D2 Ep2 P2 torch AdamW llep/2, 2 micro-batches", 2,
     [*MOP[:1], *LORA, "--optim.offload=false", "--data.seq_len=2048", "--parallel.sequence=2",
      "--parallel.expert=2", "--parallel.vocab=2", "--train.global_batch=2", "--parallel.llep_chunks=2"]),
    ("mop LoRA on an fp8 base D4 Ep4 P4 ac+offload", 4,
     [*MOP, *LORA, "--data.seq_len=8192", "--parallel.sequence=4", "--parallel.expert=4", "--parallel.vocab=4",
      "--train.global_batch=1", AC, OFFLOAD]),
]


def _config(world: int, settings: list[str]):
    return settle(load_config(None, [*COMMON, f"--parallel.nproc={world}", *settings]), world, fit_memory=False)


def _measure_all(rank: int, world: int, cases: list[list[str]]) -> list[dict]:
    return [step_memory(Trainer(_config(world, settings), rank, "packed")) for settings in cases]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every case's worst-rank measurement, one launch per world size."""
    out = {}
    for world in sorted({w for _, w, _ in CASES}):
        mine = [(name, settings) for name, w, settings in CASES if w == world]
        per_rank = run_distributed(_measure_all, world, [s for _, s in mine], timeout=900)
        for index, (name, _) in enumerate(mine):
            out[name] = {"device": max(r[index]["device"] for r in per_rank),
                         "parameters": max(r[index]["parameters"] + r[index]["host_parameters"] for r in per_rank)}
    return out


@pytest.mark.slow
def test_predicted_device_peak_is_within_10_percent_of_the_measured_one(measured):
    rows, failures = [], []
    for name, world, settings in CASES:
        config = _config(world, settings)
        predicted = estimate(config, world, world)
        got = measured[name]
        p = config.parallel
        counts = parameter_counts(config.model, world, p.expert, p.vocab)
        # the shards' bytes exactly (in host memory under FSDP2's CPU offload): the model's rules
        # for who holds which rows and in which dtype are the runtime's
        shards = counts.local * 4 if config.adapters is None else sum(predicted.adapters.bytes_by_category.values())
        assert shards == got["parameters"], name
        ratio = predicted.peak_device_bytes / got["device"]
        rows.append(f"{name:<44} W={world}  predicted {predicted.peak_device_bytes / MIB:7.1f} MiB  measured "
                    f"{got['device'] / MIB:7.1f} MiB  ratio {ratio:.3f}  ({predicted.peak.name.split(':')[0]})")
        if not 0.9 <= ratio <= 1.1:
            failures.append(name)
    print("\npredicted vs measured per-rank device peak (worst rank):\n" + "\n".join(rows))
    assert len(CASES) >= 8
    assert not failures, f"off by more than 10%: {failures}\n" + "\n".join(rows)


# each preset on a cluster it fits at 128K (the paper's for its three models)
PRESET_NODES = {"mop-120b": 2, "mop-600b": 8, "mop-1t": 12, "qwen3-235b-a22b": 4, "qwen3-30b-a3b": 1, "mixtral-8x7b": 1}


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow if p != "qwen3-30b-a3b" else ())
                                    for p in PRESET_NODES])
def test_the_planners_choice_is_accepted_by_mop_train(preset):
    """The printed `mop train` settings, applied to the preset's own config file, pass the trainer's
    validation for the cluster's world size and node size."""
    from mop.plan.report import train_settings

    cluster = make_cluster("h200", PRESET_NODES[preset], 8)
    chosen = plan(load_model(preset), cluster, 131072)["mop"].best
    assert chosen is not None and chosen.config.parallel.strategy == "mop"
    assert chosen.memory.peak_device_bytes <= cluster.budget_bytes
    # as `torchrun --nnodes 2 --nproc-per-node 8 -m mop.cli train <preset> <settings>` loads it
    config = load_config(CONFIGS / f"{preset}.toml", train_settings(chosen))
    resolved = settle(config, world=cluster.world, local_world=cluster.gpus_per_node, fit_memory=False)
    assert resolved.parallel == chosen.config.parallel
    assert estimate(resolved, cluster.world, 8).peak_device_bytes == chosen.memory.peak_device_bytes


def test_presets_carry_their_sources_and_paper_sizes():
    # the published totals, less the multi-token-prediction layer mop leaves out (GLM-4.5: 355B)
    sizes = {"mop-120b": (110e9, 125e9), "mop-600b": (600e9, 700e9), "mop-1t": (0.95e12, 1.1e12),
             "glm-4.5": (345e9, 355e9), "glm-4.5-air": (103e9, 109e9),
             "deepseek-v3": (668e9, 674e9), "kimi-k2": (1.02e12, 1.05e12), "gpt-oss-120b": (116e9, 118e9),
             "gpt-oss-20b": (20.5e9, 21.5e9)}
    for preset, (low, high) in sizes.items():
        text = (CONFIGS / f"{preset}.toml").read_text()
        assert "config.json" in text  # the shapes' source is written in the file
        total = parameter_counts(load_model(preset), 8, 1, 1).total
        assert low <= total <= high, (preset, total)
    assert {"mop-120b", "mop-600b", "mop-1t", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"} <= set(presets())


def test_plan_json_has_the_documented_keys(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h100",
                 "--context", "32K", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for side, layout in (("mop", "layout"), ("fsdp2_best", "config")):
        assert isinstance(out[side]["fits"], bool)
        assert out[side]["peak_device_bytes"] > 0
        assert layout in out[side]
    assert out["mop"]["fits"] and out["mop"]["tokens_per_s_per_gpu"] > 0
    assert out["mop"]["peak_device_bytes"] <= out["mop"]["budget_device_bytes"]
    assert set(out["mop"]["layout"]) >= {"sequence", "expert", "vocab", "attention_head_chunks", "llep_chunks",
                                         "activation_checkpointing", "offload_activations", "host_optimizer",
                                         "micro_batch"}
    assert set(out["fsdp2_best"]["config"]) >= {"fsdp", "ep", "cp", "tp", "cpu_offload"}


@pytest.mark.slow
def test_contexts_print_the_table1_shape(capsys):
    assert main(["plan", "mop-120b", "--nodes", "2", "--gpu", "h200", "--contexts", "128K,1M"]) == 0
    out = capsys.readouterr().out
    assert "MoP tok/s/GPU" in out and "FSDP-best config" in out
    assert "\n128K " in out and "\n1M " in out


@pytest.mark.slow
def test_more_memory_never_makes_a_plan_slower_and_longer_context_never_faster():
    """Monotonicity the search must keep: a bigger GPU only widens the choice (nothing slower, up to
    the 2% the pick trades for headroom); a longer context cannot be faster per token (attention grows)."""
    model = load_model("mop-120b")
    small, big = make_cluster("h100", 2, 8), make_cluster("h200", 2, 8)
    slow, fast = (plan(model, c, 131072)["mop"].best for c in (small, big))
    assert fast is not None and (slow is None or fast.tokens_per_s_per_gpu >= slow.tokens_per_s_per_gpu * 0.98)
    longer = plan(model, big, 262144)["mop"].best
    assert longer is not None and longer.tokens_per_s_per_gpu < fast.tokens_per_s_per_gpu


@pytest.mark.parametrize("text,tokens", [("131072", 131072), ("128K", 131072), ("1M", 1048576), ("64k", 65536)])
def test_context_sizes(text, tokens):
    assert parse_tokens(text) == tokens


def test_hf_config_json_is_a_model(tmp_path):
    from mop.models.hf import config_to_hf

    model = load_model("qwen3-30b-a3b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_hf(model, "qwen3_moe", torch.bfloat16)))
    assert load_model(str(path)) == model
    assert load_model(str(tmp_path)) == model


def test_host_memory_counts_the_rollback_copies_only_when_speculating():
    base = ["--parallel.strategy=mop", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
            "--train.global_batch=1", "--data.seq_len=2048", "--optim.offload=true", "--train.dtype=bfloat16"]
    spec = estimate(_config(2, base), 2, 2).host_bytes_per_rank["optimizer"]
    plain = estimate(_config(2, [*base, "--optim.speculative=false"]), 2, 2).host_bytes_per_rank["optimizer"]
    params = parameter_counts(load_config(None, MODEL).model, 2, 2, 2).local
    assert spec - plain == 12 * params
    assert plain == (16 + 2) * params  # master, moments, gradient accumulator; bf16 staging


def test_the_docs_show_a_plan_example():
    page = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    assert page.startswith("# Will it fit?") and "mop plan " in page


def test_lora_keeps_the_published_base_and_fits_deepseek_v3_at_128k_on_one_h200_node():
    """`--finetune lora` plans the frozen base as published (the preset's fp8), with state for the
    adapters alone: DeepSeek-V3 at 128K fits one H200 node, which full fine-tuning does not; its
    printed settings pass `mop train`'s validation and predict the same peak."""
    from mop.models.lora import LoraConfig
    from mop.plan import published_format
    from mop.plan.report import train_settings

    cluster, model = make_cluster("h200", 1, 8), load_model("deepseek-v3")
    assert published_format("deepseek-v3") == "fp8" and published_format("qwen3-235b-a22b") == "none"
    chosen = plan(model, cluster, 131072, lora=LoraConfig(base_format="fp8"))["mop"].best
    assert chosen is not None and chosen.memory.peak_device_bytes <= cluster.budget_bytes
    adapters = chosen.memory.adapters
    assert 0 < adapters.trained < chosen.memory.counts.local // 100
    # the routed experts' shards as fp8 with fp32 128x128 block scales: about 1 byte per parameter
    assert chosen.memory.counts.experts <= adapters.bytes_by_category["experts"] < 1.02 * chosen.memory.counts.experts
    config = load_config(CONFIGS / "deepseek-v3.toml", train_settings(chosen))
    resolved = settle(config, world=cluster.world, local_world=cluster.gpus_per_node, fit_memory=False)
    assert resolved.lora == chosen.config.lora and resolved.parallel == chosen.config.parallel
    assert estimate(resolved, cluster.world, 8).peak_device_bytes == chosen.memory.peak_device_bytes


@pytest.mark.parametrize("model_name, base", [("qwen3-235b-a22b", "none"), ("gpt-oss-120b", "mxfp4")])
def test_dpo_plans_lora_with_the_bases_reference_forward_in_every_step(model_name, base):
    """`--dpo`: a sequence of pairs costs the memory of any sequence of its tokens (the response sums
    are a few numbers per pair); with LoRA the base's reference forward adds one forward's FLOPs and
    traffic to every step; full fine-tuning's reference is precomputed once, so its steps cost what
    supervised steps do. Qwen3-235B-A22B and gpt-oss-120b with LoRA fit 128K on one H200 node."""
    from mop.models.lora import LoraConfig
    from mop.cost.candidates import evaluate

    cluster, model = make_cluster("h200", 1, 8), load_model(model_name)
    lora = LoraConfig(base_format=base)
    dpo = plan(model, cluster, 131072, lora=lora, objective=OBJECTIVES["dpo"])["mop"].best
    assert dpo is not None and dpo.memory.peak_device_bytes <= cluster.budget_bytes
    assert dpo.config.dpo.reference == "base" and dpo.config.data.format == "preference"
    config = dpo.config
    supervised = evaluate(dataclasses.replace(config, data=dataclasses.replace(config.data, format="text")), cluster)
    assert supervised.memory.peak_device_bytes == dpo.memory.peak_device_bytes
    forward = dpo.time.forward
    assert dpo.time.compute == pytest.approx(supervised.time.compute + forward, rel=1e-9)
    assert dpo.time.seconds > supervised.time.seconds
    full = plan(model, make_cluster("h200", 2, 8), 65536, objective=OBJECTIVES["dpo"])["mop"]
    assert full.best is None or full.best.config.dpo.reference == "precomputed"


def test_grpo_plans_the_bases_kl_forward_only_with_a_kl():
    """`--grpo`: a sequence of packed rollouts costs what a supervised one does (routing replay forces a
    selection the router computes anyway); with LoRA and `--rl-beta` the base's forward for the KL's
    reference adds one forward to every step, as DPO's does. `mop plan --grpo` says so."""
    from mop.models.lora import LoraConfig
    from mop.cost.candidates import evaluate

    cluster, model = make_cluster("h200", 1, 8), load_model("qwen3-30b-a3b")
    lora = LoraConfig(base_format="fp8")
    plain = plan(model, cluster, 131072, lora=lora, objective=OBJECTIVES["grpo"])["mop"].best
    assert plain.config.data.format == "rollouts" and plain.config.rl.reference == "none"
    config = plain.config
    supervised = evaluate(dataclasses.replace(config, data=dataclasses.replace(config.data, format="text")), cluster)
    assert plain.time.compute == pytest.approx(supervised.time.compute, rel=1e-12)
    with_kl = evaluate(dataclasses.replace(config, rl=dataclasses.replace(config.rl, beta=0.04, reference="base")),
                       cluster)
    assert with_kl.time.compute == pytest.approx(plain.time.compute + plain.time.forward, rel=1e-9)
    assert main(["plan", "qwen3-30b-a3b", "--nodes", "1", "--context", "128K", "--gpu", "h200", "--finetune", "lora",
                 "--grpo", "--rl-beta", "0.04"]) == 0
