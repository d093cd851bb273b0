"""`mop bench context`: `mop train` at long packed-document context, and plain FSDP2 on Hugging Face's model.

What runs (each a fresh set of the config's local CPU ranks, 2 in the preset, one intra-op thread each):
- mop, per context in `--contexts`: the user's command, `mop train configs/long-context.toml
  --data.seq_len=S` (every mop technique: Ulysses over both ranks, LLEP, the vocabulary ring, the
  host optimizer, activation checkpointing with host offload; the shipped corpus packed with
  document boundaries; one step is 2 sequences). Reported: each rank's peak resident memory
  (`metrics.jsonl`'s `peak_mem_bytes_per_rank`, the process's lifetime peak RSS on CPU) and the
  median step time after the first step. A run killed by the kernel (out of memory) is reported
  as such, and longer contexts are not tried.
- At `--compare-context` (16K), the same work per rank three ways (one S-token sequence per rank
  per step, 2 ranks, same model shape, fp32):
  * mop (the preset above);
  * `mop train ... --parallel.strategy=fsdp2` with every memory option off: plain FSDP2 on mop's
    model, the packed documents attended within documents by mop's kernel;
  * hf-fsdp2: transformers' `Qwen3MoeForCausalLM` of the same shape (`mop.models.hf.config_to_hf`),
    FSDP2 on every decoder layer and the root, torch AdamW, on the same sequences. It attends
    causally over the whole row (no document mask: transformers' packed-document path needs
    flash attention, which has no CPU kernel), builds the full logits, and has no load-balancing
    loss: strictly less work than the two mop runs. Its peak is the process's peak RSS too.
  Reported: seconds per step and tokens/s per rank, and each one's ratio to hf-fsdp2.

Memory on CPU is resident memory, so it includes what a GPU machine would keep in host memory
(the offloaded block inputs, the host optimizer's state); `mop bench e2e` splits device and host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mop.bench.report import table, write_json
from mop.config import ConfigError, load_config
from mop.resolve import resolve

PRESET = Path(__file__).resolve().parents[2] / "configs" / "long-context.toml"
GB = 1e9
PLAIN_FSDP2 = ["--parallel.strategy=fsdp2", "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
               "--train.activation_checkpointing=none", "--train.offload_activations=false"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=PRESET, help="the mop train config (the long-context preset)")
    parser.add_argument("--contexts", default="16384,32768,65536,131072", help="tokens per sequence, comma-separated")
    parser.add_argument("--compare-context", type=int, default=16384,
                        help="context of the comparison with plain FSDP2 (0: none)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is not timed")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/context.json"))


def mop_train(args, name: str, context: int, extra: list[str]) -> dict:
    """`mop train` in a subprocess; its metrics, or how it failed."""
    run_dir = args.out.with_name(f"{args.out.stem}-runs") / f"{name}-{context}"
    command = [sys.executable, "-m", "mop.cli", "train", str(args.config), f"--data.seq_len={context}",
               f"--train.steps={args.steps}", f"--log.run_dir={run_dir}", "--log.overwrite=true",
               "--log.progress=false", "--log.plot=false", "--log.tensorboard=false", *extra]
    start = time.perf_counter()
    result = {"system": name, "context": context, "command": " ".join(command[2:])}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**result, "returncode": None, "error": f"took more than --timeout={args.timeout} s"}
    result.update(wall_s=time.perf_counter() - start, returncode=done.returncode)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("mop: error")]
        result["error"] = errors[-1] if errors else done.stderr[-2000:]
        result["out_of_memory"] = "out-of-memory" in result["error"]
        return result
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else records[0]["step_time_s"]
    config = resolve(load_config(str(args.config), [f"--data.seq_len={context}", *extra]))
    tokens_per_rank = config.train.global_batch * context / config.parallel.nproc
    return {**result, "peak_bytes_per_rank": records[-1]["peak_mem_bytes_per_rank"], "seconds_per_step": seconds,
            "tokens_per_s_per_rank": tokens_per_rank / seconds, "losses": [r["loss"] for r in records],
            "last_record": records[-1]}


def hf_rank(rank: int, world: int, config_path: str, context: int, steps: int) -> dict:
    """One rank of plain FSDP2 on transformers' Qwen3-MoE: its sequence of each step, forward, backward, AdamW."""
    import resource

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mop.data import build_data
    from mop.models.hf import config_to_hf

    config = load_config(config_path, [f"--data.seq_len={context}"])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_to_hf(config.model, "qwen3_moe")))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    d = config.data
    data = build_data(d.source, d.tokenizer, d.seq_len, config.train.seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        indices = data.stream.next_batch(world)  # one sequence per rank, as mop's plain FSDP2 run takes them
        item = data.dataset[indices[rank]]
        logits = model(input_ids=item["input_ids"].unsqueeze(0)).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), item["labels"],
                                                 ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"times": times, "peak_bytes": peak, "loss": loss.item()}


def hf_fsdp2(args, context: int) -> dict:
    from mop.testing import run_distributed

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("mop bench context", "the Hugging Face baseline needs transformers; install mop's test "
                          "extras (./mop.sh test does) or skip it with --compare-context=0") from None
    start = time.perf_counter()
    world = resolve(load_config(str(args.config), [])).parallel.nproc  # the ranks mop's runs use
    per_rank = run_distributed(hf_rank, world, str(args.config), context, args.steps, timeout=args.timeout)
    seconds = statistics.median(max(r["times"][i] for r in per_rank) for i in range(1, args.steps))
    return {"system": "hf-fsdp2", "context": context, "wall_s": time.perf_counter() - start, "returncode": 0,
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank], "seconds_per_step": seconds,
            "tokens_per_s_per_rank": context / seconds, "losses": [per_rank[0]["loss"]]}


def run(args) -> dict:
    if args.steps < 2:
        raise ConfigError("--steps", "must be at least 2 (the first step is not timed)")
    contexts = [int(c) for c in args.contexts.split(",")]
    runs = []
    for context in contexts:
        runs.append(mop_train(args, "mop", context, []))
        print(_line(runs[-1]), flush=True)
        if runs[-1]["returncode"] != 0:
            break
    comparison = []
    if args.compare_context:
        same = [r for r in runs if r["context"] == args.compare_context]
        comparison = same or [mop_train(args, "mop", args.compare_context, [])]
        comparison.append(mop_train(args, "mop-fsdp2", args.compare_context, PLAIN_FSDP2))
        comparison.append(hf_fsdp2(args, args.compare_context))
        for row in comparison[len(same):]:
            print(_line(row), flush=True)
    return {"runs": runs, "comparison": comparison}


def _line(row: dict) -> str:
    if row["returncode"] != 0:
        return f"  {row['system']} S={row['context']}: failed: {row['error']}"
    peaks = ", ".join(f"{p / GB:.2f}" for p in row["peak_bytes_per_rank"])
    return f"  {row['system']} S={row['context']}: {row['seconds_per_step']:.1f} s/step, peak GB per rank [{peaks}]"


def report(args, results: dict) -> None:
    rows = [[r["context"], max(r["peak_bytes_per_rank"]) / GB if r["returncode"] == 0 else "OOM" if
             r.get("out_of_memory") else "failed", r.get("seconds_per_step", "-"), r.get("tokens_per_s_per_rank", "-")]
            for r in results["runs"]]
    print(table(f"mop train {args.config.name}, 2 ranks, packed documents: per-rank peak resident memory and step time",
                ["context", "peak GB/rank", "s/step", "tok/s/rank"], rows))
    if results["comparison"]:
        hf = results["comparison"][-1]
        rows = [[r["system"], r.get("seconds_per_step", "-"), r.get("tokens_per_s_per_rank", "-"),
                 r["tokens_per_s_per_rank"] / hf["tokens_per_s_per_rank"] if r["returncode"] == 0 else "-",
                 max(r["peak_bytes_per_rank"]) / GB if r["returncode"] == 0 else "-"] for r in results["comparison"]]
        print()
        print(table(f"same work per rank at {args.compare_context} tokens (one sequence per rank per step)",
                    ["system", "s/step", "tok/s/rank", "vs hf-fsdp2", "peak GB/rank"], rows))
    path = write_json(args.out, "context", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
