"""`mop bench rl-sync`: exporting the trainer's weights for an inference engine, seconds and peak
memory per rank against the bucket size.

What runs: two gloo ranks (one intra-op thread each; with `--device cuda`, one NCCL rank per GPU, at
most two, Ep and P as many) build a real-shape preset's run as `mop train`
builds it (`mop.build.build_run`: FSDP2 over the ranks, its experts over Ep = 2 with LLEP, the
vocabulary ring P = 2; fp32 weights, initialised, never trained) with `--layers` of its blocks
(default 1: a real layer's tensors, not the whole model), then export its weights
(`mop.rl.weights.weight_buckets`: every parameter reduced once to rank 0, cut into the hub layout's
tensors, in bf16) for each `--buckets` size, rank 0 handing each bucket to nothing (the sender's
own cost, a file or an engine's API, is not measured).

Reported per bucket size: the measured export's seconds (worst rank), buckets, bytes sent, the
export's transient peak per rank (`mop.testing.memory.PeakMemory`: what the export allocates above
the run's own tensors, worst rank), and the whole preset's seconds by the plan: the measured seconds
per byte times the preset's bf16 bytes (`mop.models.spec`), which is how the export scales (each
parameter once, layer by layer). Times on this machine are noisy and its gloo is no NCCL: compare the
bucket sizes with each other, not with a GPU cluster's seconds. On CUDA the peak is the GPU's (the
gathered tensors; the buckets rank 0 copies to the host are not in it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mop.bench.report import MIB, table, write_json
from mop.build import build_run
from mop.config import load_config
from mop.models.families import model_spec
from mop.parallel import DistLayout, Layout
from mop.rl.weights import weight_buckets
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import rank_device, run_distributed
from mop.testing.memory import PeakMemory

WORLD = 2
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="a configs/ preset (default qwen3-30b-a3b)")
    parser.add_argument("--layers", type=int, default=1, help="blocks of it built and exported (default 1)")
    parser.add_argument("--buckets", default="128,512,2048", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 gloo ranks; cuda: one rank per GPU, at most 2")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/rl-sync.json"))


def world_of(device: str) -> int:
    return WORLD if device == "cpu" else min(WORLD, torch.cuda.device_count())


def settings(args) -> list[str]:
    world = world_of(args.device)
    return [f"--model.layers={args.layers}", "--model.dense_layers=0", "--parallel.strategy=mop",
            f"--parallel.nproc={world}", "--parallel.sequence=1", f"--parallel.expert={world}",
            f"--parallel.vocab={world}", "--parallel.expert_balance=llep", "--train.dtype=float32",
            f"--train.device={args.device}", "--optim.offload=false",
            "--data.seq_len=64", "--train.global_batch=2", "--train.micro_batch=1", "--train.finetune=full",
            "--eval.every=0"]


def export(rank: int, world: int, preset: str, overrides: list[str], buckets: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    config = settle(load_config(preset, overrides), world, fit_memory=False)
    p, device = config.parallel, rank_device()
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), device)
    run = build_run(config, Runtime(rank, world, device, layout))
    results = []
    for size in buckets:
        count = sent = 0
        with PeakMemory(device) as memory:
            start = time.perf_counter()
            for bucket in weight_buckets(run, size, torch.bfloat16):
                count, sent = count + 1, sent + sum(t.nbytes for _, t in bucket)
            seconds = time.perf_counter() - start
        results.append({"bucket_bytes": size, "buckets": count, "bytes": sent, "seconds": seconds,
                        "peak_bytes": memory.peak_bytes})
    return results


def run(args) -> dict:
    preset = CONFIGS / f"{args.preset}.toml"
    if not preset.is_file():
        raise SystemExit(f"mop: error: --preset {args.preset!r} is not one of {CONFIGS}/*.toml")
    buckets = [int(float(b) * MIB) for b in args.buckets.split(",")]
    ranks = run_distributed(export, world_of(args.device), str(preset), settings(args), buckets, timeout=3600,
                            device=args.device)
    whole = 2 * model_spec(load_config(str(preset)).model).total_parameters  # the preset's bf16 bytes
    rows = []
    for at, size in enumerate(buckets):
        per_rank = [r[at] for r in ranks]
        measured = per_rank[0]
        seconds = max(r["seconds"] for r in per_rank)
        rows.append({**measured, "seconds": seconds, "peak_bytes": max(r["peak_bytes"] for r in per_rank),
                     "whole_model_seconds": seconds / max(measured["bytes"], 1) * whole})
    return {"preset": args.preset, "measured_layers": args.layers, "whole_model_bytes": whole, "runs": rows}


def report(args, results: dict) -> None:
    rows = [[r["bucket_bytes"] / MIB, r["buckets"], r["bytes"] / MIB, r["seconds"], r["peak_bytes"] / MIB,
             r["whole_model_seconds"]] for r in results["runs"]]
    world = world_of(args.device)
    print(table(f"mop bench rl-sync: {args.preset}'s weights in bf16 from {world} {args.device} rank(s) (Ep {world}, "
                f"P {world}, FSDP2), "
                f"{args.layers} block(s) measured, the whole model ({results['whole_model_bytes'] / 2**30:.1f} GiB) "
                "by the plan (seconds per byte)",
                ["bucket MiB", "buckets", "sent MiB", "export s", "peak MiB per rank", "whole model s"], rows))
    print(f"wrote {write_json(args.out, 'rl-sync', vars(args) | {'out': str(args.out)}, results)}")
