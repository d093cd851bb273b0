"""`mop bench lora`: per-rank device memory and step time of LoRA over an fp8 base against full fine-tuning.

What runs: two gloo ranks (one intra-op thread each) train the anchor-shaped MoE (hidden 256, 4
blocks, 8 heads / 2 kv heads of 32, 16 experts of width 256 with 2 per token, vocabulary 32000)
on one packed sequence of `--context` tokens of the shipped corpus per step (the same tokens for
both runs), in `mop train`'s default layout on 2 ranks (Ulysses D = 2, LLEP over Ep = 2, the
vocabulary ring P = 2, documents attended within themselves, fp32) with full activation
checkpointing, twice in the same process tree:
- full: every parameter trains (the host optimizer, as `optim.offload = "auto"` picks);
- lora: `train.finetune = "lora"`, rank `--rank` on attention and the routed experts, the frozen
  base kept as fp8 e4m3 in 128x128 blocks (`lora.base_format = "fp8"`, the run's initial weights
  quantized, as DeepSeek-V3 publishes its weights), the optimizer "auto" picks for the adapters.
Each run is built by `mop.build.build_run` and stepped by the trainer's own `train_step` and
`update` (`mop.testing.step.Trainer`), as `mop train` does; it differs from `mop train` only in
training the same batch every step at the constant `optim.lr`.

Reported per run: the per-rank device memory a GPU would need (`mop.testing.step.step_memory`: the
persistent shards and optimizer state read from the tensors, plus the step's transient peak; worst
rank), what `mop plan`'s memory model predicts for the same config, the parameters' device bytes,
and the median time of `--steps` timed steps after the warm-up and memory steps; then LoRA's ratios
to full. Times on this machine are noisy: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import ANCHOR, add_shape_arguments, shape_overrides
from mop.config import load_config
from mop.cost.memory import estimate
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.step import timed_steps

WORLD = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, **ANCHOR)
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence (one sequence per step)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--targets", default="attention,routed_experts", help="lora.targets")
    parser.add_argument("--base-format", default="fp8", help="lora.base_format of the frozen base")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after a warm-up and a memory step")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/lora.json"))


def settings(args, finetune: str) -> list[str]:
    """The `mop train` overrides of one run: the shape, the layout, and LoRA's own settings."""
    shape = shape_overrides(args)
    run = ["--parallel.strategy=mop", f"--parallel.nproc={WORLD}", "--train.dtype=float32", "--train.device=cpu",
           f"--data.seq_len={args.context}", "--train.global_batch=1", "--train.micro_batch=1",
           "--train.activation_checkpointing=full", "--train.seed=0", f"--train.finetune={finetune}"]
    lora = [f"--lora.rank={args.rank}", f"--lora.targets={args.targets}", f"--lora.base_format={args.base_format}"]
    return [*shape, *run, *(lora if finetune == "lora" else [])]


def _config(overrides: list[str]):
    return settle(load_config(None, overrides), WORLD, fit_memory=False)


def measure(args, finetune: str) -> dict:
    overrides = settings(args, finetune)
    ranks = run_distributed(timed_steps, WORLD, overrides, args.steps, timeout=3600)
    config = _config(overrides)
    worst = max(ranks, key=lambda r: r["device"])
    return {"finetune": finetune, "settings": overrides, "device_bytes": worst["device"],
            "predicted_device_bytes": estimate(config, WORLD, WORLD).peak_device_bytes,
            "parameter_bytes": worst["parameters"], "optimizer_bytes": worst["optimizer_state"],
            "host_optimizer_bytes": worst["host_optimizer_state"], "step_peak_bytes": worst["step_peak"],
            "step_s": max(r["step_s"] for r in ranks), "host_optimizer": config.optim.offload}


def run(args) -> dict:
    full, lora = measure(args, "full"), measure(args, "lora")
    return {"runs": [full, lora], "lora_over_full": {
        "device_bytes": lora["device_bytes"] / full["device_bytes"], "step_s": lora["step_s"] / full["step_s"]}}


def report(args, results: dict) -> None:
    rows = [[r["finetune"], r["device_bytes"] / MIB, r["predicted_device_bytes"] / MIB, r["parameter_bytes"] / MIB,
             (r["optimizer_bytes"] + r["host_optimizer_bytes"]) / MIB, r["step_peak_bytes"] / MIB, r["step_s"]]
            for r in results["runs"]]
    ratio = results["lora_over_full"]
    rows.append(["lora / full", ratio["device_bytes"], "", "", "", "", ratio["step_s"]])
    print(table(f"mop bench lora: {args.context} tokens per step on {WORLD} ranks, rank {args.rank} on {args.targets} "
                f"over a {args.base_format} base vs full fine-tuning (per rank, worst rank; fp32, checkpointing)",
                ["run", "device MiB", "plan MiB", "params MiB", "optimizer MiB (dev+host)", "step peak MiB",
                 "step s"], rows))
    print(f"wrote {write_json(args.out, 'lora', vars(args) | {'out': str(args.out)}, results)}")
