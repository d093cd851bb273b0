"""`mop bench gpu`: on a GPU machine, the CUDA test tier and a short bf16 training of a real-shaped model.

What runs (every GPU of the machine, one rank each):
1. the CUDA tier: `pytest -m cuda` (component and end-to-end losslessness tests on NCCL);
2. `mop train CONFIG` (default the Qwen3-30B-A3B preset) in bf16 with every technique the preset
   turns on (Ulysses, LLEP, the vocabulary ring, activation checkpointing with offload, the host
   optimizer), with `--layers` blocks (0: as many as the GPUs' memory holds, from the bf16 working
   weights at 2 bytes per parameter in a quarter of the memory), at the longest of `--contexts`
   that trains; then, in the same run and at the same context, the same training with torch AdamW
   stepping after the backward on the device (`--optim.offload=false`), for the step time.
Reported from each run's `metrics.jsonl` (median after the first step): tokens/s per GPU, model
TFLOP/s per GPU and MFU (`mop.flops`: causal attention counts the keys each query attends), the
peak device memory (`torch.cuda.max_memory_allocated`), the device bytes per parameter by
category, and the host optimizer's exposed time; and the step-time ratio of the two optimizers.
On a machine without a GPU it stops with one line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from mop.bench.context import mop_train
from mop.bench.report import table, write_json
from mop.config import ConfigError, load_config
from mop.flops import matmul_params_per_token

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen3-30b-a3b.toml"
GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=PRESET, help="the model and settings to train")
    parser.add_argument("--layers", type=int, default=0, help="blocks to build (0: as many as fit)")
    parser.add_argument("--contexts", default="131072,65536,32768,16384,8192",
                        help="contexts to try, longest first; the first that trains is reported")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is not timed")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the CUDA tier")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gpu.json"))


def layers_that_fit(config, gpus: int) -> int:
    """Blocks whose bf16 working weights fill about a quarter of the GPUs' memory (activations,
    gathered weights and buffers take the rest)."""
    cfg = config.model
    per_layer = (matmul_params_per_token(cfg) - cfg.hidden * cfg.vocab_size
                 + cfg.layers * (cfg.experts - cfg.top_k) * 3 * cfg.hidden * cfg.expert_intermediate) / cfg.layers
    budget = 0.25 * gpus * torch.cuda.get_device_properties(0).total_memory - 2 * 2 * cfg.hidden * cfg.vocab_size
    return max(1, min(cfg.layers, int(budget // (2 * per_layer))))


def cuda_tier() -> dict:
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True)
    return {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]}


def summarise(row: dict) -> dict:
    """The reported numbers of one run (medians after the first step, the last step's state)."""
    if row["returncode"] != 0:
        return {"error": row.get("error")}
    last = row["last_record"]
    return {"seconds_per_step": row["seconds_per_step"], "tokens_per_s_per_gpu": row["tokens_per_s_per_rank"],
            "model_tflops_per_s_per_gpu": last.get("model_tflops_per_s_per_rank"), "mfu": last.get("mfu"),
            "peak_device_bytes": max(row["peak_bytes_per_rank"]),
            "device_bytes_per_param": {k: last[f"device_bytes_per_param_{k}"] for k in ("weights", "gradients",
                                                                                        "optimizer")},
            "optimizer_exposed_s": last.get("optimizer_exposed_s")}


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise ConfigError("mop bench gpu", "needs a CUDA GPU and none is visible; run it on a GPU machine")
    gpus = torch.cuda.device_count()
    config = load_config(str(args.config), [f"--parallel.nproc={gpus}"])
    layers = args.layers or layers_that_fit(config, gpus)
    common = [f"--model.layers={layers}", f"--model.dense_layers={min(config.model.dense_layers, layers - 1)}",
              "--train.device=cuda", "--train.dtype=bfloat16", f"--parallel.nproc={gpus}", "--parallel.sequence=0",
              "--parallel.expert=0", "--parallel.vocab=0", "--checkpoint.every=0"]
    results = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "layers": layers,
               "cuda_tier": None if args.skip_tests else cuda_tier()}
    for context in (int(c) for c in args.contexts.split(",")):
        host = mop_train(args, "host-optimizer", context, [*common, "--optim.offload=true"])
        if host["returncode"] == 0:
            adamw = mop_train(args, "torch-adamw", context, [*common, "--optim.offload=false"])
            results.update(context=context, host_optimizer=summarise(host), torch_adamw=summarise(adamw))
            break
        print(f"  {context} tokens: {host.get('error')}", flush=True)
    return results


def report(args, results: dict) -> None:
    print(f"{results['device']} x {results['gpus']}, {args.config.name} with {results['layers']} layer(s), bf16")
    if results["cuda_tier"] is not None:
        print(f"CUDA tier (pytest -m cuda): {' '.join(results['cuda_tier']['summary'])}")
    if "context" not in results:
        print("no context of --contexts trained")
    else:
        rows = []
        for name in ("host_optimizer", "torch_adamw"):
            r = results[name]
            rows.append([name, r.get("seconds_per_step", "failed"), r.get("tokens_per_s_per_gpu", "-"),
                         r.get("model_tflops_per_s_per_gpu") or "-", r.get("mfu") or "-",
                         r["peak_device_bytes"] / GB if "peak_device_bytes" in r else "-",
                         r.get("optimizer_exposed_s") or "-"])
        print(table(f"context {results['context']} (MFU: causal attention counts the keys each query attends)",
                    ["optimizer", "s/step", "tok/s/GPU", "TFLOP/s/GPU", "MFU", "peak GB", "optimizer exposed s"],
                    rows))
        host, adamw = results["host_optimizer"], results["torch_adamw"]
        if "seconds_per_step" in host and "seconds_per_step" in adamw:
            print(f"step time, host optimizer / torch AdamW: {host['seconds_per_step'] / adamw['seconds_per_step']:.3f}")
        print(f"device bytes per parameter (host optimizer): {host.get('device_bytes_per_param')}")
    path = write_json(args.out, "gpu", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"results written to {path}")
