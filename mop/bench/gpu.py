"""`mop bench gpu`: the acceptance test of a machine of 1, 2, 4 or 8 GPUs: the CUDA test tier and a
short bf16 training of a real-shaped model, sized by the planner's memory model.

Sizing (`plan`): CONFIG (default the Qwen3-30B-A3B preset), its parallel degrees resolved for
world = the GPUs as `mop train` resolves them, keeps at each context of `--contexts` the most
blocks (at most `--layers`) whose predicted peak device bytes per GPU (`mop.cost.memory.estimate`)
fit the device memory less `--reserve-gib` and whose predicted host bytes fit 80% of the host's:
the node's host optimizer holds the whole model (fp32 master, moments, rollback copies,
accumulator, pinned staging: about 30 bytes per parameter) and the offloaded activations, so on
128 GiB the host sets the size. The torch AdamW comparison (16+ bytes per parameter on the
device) is sized alike, with at most as many blocks. A context where one block does not fit is
not run.

What runs (one rank per GPU) within `--budget` seconds (480: the defaults fit 8 minutes on one
H100, under a remote runner's 10-minute limit): the CUDA tier, `./mop.sh test -m cuda -rs`, in at most
40% of it (the tests skipped for needing more GPUs are listed); then `mop train CONFIG`, `--steps`
(3) bf16 steps with what the preset turns on (Ulysses, LLEP, the vocabulary ring, activation
checkpointing with offload, the host optimizer) at the longest planned context, the next if it
fails; then torch AdamW at that context or the longest shorter one where its model fits. A run
may take what is left of the budget over the runs to come (at most `--timeout`). Each runs in a
forked process of its own session: what a timed-out run leaves is killed, and its peak host
memory is `ru_maxrss` of the processes it waited for, the largest single process's peak resident
set (on CUDA the trainer's `peak_mem_bytes` is the device allocator's).

Reported per run (`metrics.jsonl`, medians after the first step): context, blocks, parameters,
layout, tokens/s per GPU, model TFLOP/s per GPU and MFU (`mop.flops`), peak device and host memory
beside their predictions, the host optimizer's exposed time; the step-time ratio when both ran the
same model and context. `--dry-run --gpus N --device-gib G --host-gib M` prints and writes the plan
alone, without a GPU; otherwise a machine without one stops with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import re
import resource
import signal
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from mop.bench import child
from mop.bench.context import mop_train
from mop.bench.report import table, write_json
from mop.config import ConfigError, load_config, load_model_config
from mop.cost.candidates import Candidate, describe, evaluate
from mop.cost.cluster import GIB, Cluster, make_cluster
from mop.plan import parse_token_list
from mop.settle import settle
from mop.settle.budget import host_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
HOST_SHARE = 0.8  # of the host memory, for the plan
TIER_SHARE = 0.4  # of the budget, for the CUDA tier
RUNS = {"host_optimizer": "true", "torch_adamw": "false"}  # name -> optim.offload
TESTED = re.compile(r"^(test suite|fast tests) on torch ")  # mop.sh test's own lines
SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+:\d+): (.*)$")  # pytest -rs: count, file:line, reason


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen3-30b-a3b.toml",
                        help="the model and settings to train")
    parser.add_argument("--layers", type=int, default=0, help="the most blocks to build (0: the config's)")
    parser.add_argument("--contexts", default="128K,64K,32K,16K,8K",
                        help="contexts to try, longest first; the first that trains is reported")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is not timed")
    parser.add_argument("--budget", type=int, default=480, help="seconds the whole benchmark may take")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one run may take at most")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the CUDA tier")
    parser.add_argument("--dry-run", action="store_true", help="print and write the plan only; no GPU needed")
    parser.add_argument("--gpus", type=int, help="GPUs of the machine (default: the visible ones)")
    parser.add_argument("--device-gib", type=float, help="memory per GPU (default: the GPU's; dry run: an H100's)")
    parser.add_argument("--reserve-gib", type=float, help="device memory left out of the plan (default 6)")
    parser.add_argument("--host-gib", type=float, help="host memory (default: this machine's, or its container's)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gpu.json"))


def machine(args) -> tuple[Cluster, str | None]:
    """The cluster to plan for (host budget: `HOST_SHARE` of its memory) and the GPU's name."""
    gpus, device_gib, name = args.gpus, args.device_gib, None
    if not args.dry_run:
        if not torch.cuda.is_available():
            raise ConfigError("mop bench gpu", "needs a CUDA GPU and none is visible; run it on a GPU machine")
        visible = torch.cuda.device_count()
        gpus = visible if gpus is None else gpus
        if gpus > visible:
            raise ConfigError("--gpus", f"{gpus} GPUs asked for but {visible} visible")
        name = torch.cuda.get_device_name(0)
        if device_gib is None:
            device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    if gpus is None or gpus < 1:
        raise ConfigError("--gpus", "a dry run needs --gpus N" if gpus is None else f"must be >= 1, got {gpus}")
    host_gib = host_memory_bytes() / GIB if args.host_gib is None else args.host_gib
    cluster = make_cluster("h100", 1, gpus, device_gib=device_gib, reserve_gib=args.reserve_gib, host_gib=host_gib)
    return dataclasses.replace(cluster, host_bytes=int(HOST_SHARE * cluster.host_bytes)), name


def settings(args, world: int, layers: int, offload: str) -> list[str]:
    """`mop train` settings of one run (the context apart): automatic degrees, `layers` blocks."""
    dense = min(load_model_config(args.config).dense_layers, layers - 1)
    return [f"--model.layers={layers}", f"--model.dense_layers={dense}", "--train.device=cuda",
            "--train.dtype=bfloat16", f"--parallel.nproc={world}", "--parallel.sequence=0", "--parallel.expert=0",
            "--parallel.vocab=0", f"--optim.offload={offload}", "--checkpoint.every=0",
            "--train.memory_budget=off"]  # the plain memory settings: the bench sizes the model to the GPU itself


def candidate(args, cluster: Cluster, context: int, layers: int, offload: str) -> Candidate:
    """The run's config as `mop train` resolves it on the cluster, with its predicted memory."""
    overrides = [f"--data.seq_len={context}", *settings(args, cluster.world, layers, offload)]
    config = settle(load_config(args.config, overrides), cluster.world, cluster.world, fit_memory=False)
    return evaluate(config, cluster)


def sized(args, cluster: Cluster, context: int, offload: str, most: int) -> Candidate | None:
    """The candidate of the most blocks, up to `most`, that fits (memory grows with the blocks: a
    bisection); None when one block does not."""
    best, low, high = None, 0, most
    while low < high:
        middle = (low + high + 1) // 2
        trial = candidate(args, cluster, context, middle, offload)
        if trial.fits:
            best, low = trial, middle
        else:
            high = middle - 1
    return best


def planned(c: Candidate | None) -> dict | None:
    return c and {"layers": c.config.model.layers, "parameters": c.memory.counts.total, "layout": describe(c),
                  "predicted_peak_device_bytes": c.memory.peak_device_bytes,
                  "predicted_host_bytes": c.memory.host_bytes_per_node}


def plan(args, cluster: Cluster) -> list[dict]:
    """Per context, the host-optimizer run and the torch AdamW run that fit (None: not even one block)."""
    most = args.layers or load_model_config(args.config).layers
    plans = []
    for context in parse_token_list(args.contexts, "--contexts"):
        host = sized(args, cluster, context, RUNS["host_optimizer"], most)
        adamw = host and sized(args, cluster, context, RUNS["torch_adamw"], host.config.model.layers)
        plans.append({"context": context, "host_optimizer": planned(host), "torch_adamw": planned(adamw)})
    return plans


def isolated(function, *args) -> dict:
    """`function(*args)` (a dict) in a forked process of its own session, with `peak_host_bytes`: the
    largest peak resident set of the processes it waited for. Whatever it leaves running is killed."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=os.setsid)
    session = pool.submit(os.getpid).result()
    try:
        return pool.submit(_measured, function, *args).result()
    finally:
        pool.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGKILL)


def _measured(function, *args) -> dict:
    return {**function(*args), "peak_host_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def cuda_tier(timeout: float, gpus: int) -> dict:
    """The README's test command on the CUDA tier (`./mop.sh test -m cuda`): pytest's summary line,
    and the skipped tests that need more than `gpus` GPUs."""
    command = [str(ROOT / "mop.sh"), "test", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    try:
        done = child.run(command, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "summary": f"took more than {timeout:.0f} s", "needs_more_gpus": []}
    # mop.sh ends with a line per environment it tested; pytest's summary is the line before them.
    lines = [line for line in done.stdout.strip().splitlines() if not TESTED.match(line)]
    skipped = [m.groups() for m in map(SKIPPED.match, lines) if m]
    return {"returncode": done.returncode, "summary": (lines or [done.stderr[-500:]])[-1],
            "needs_more_gpus": [f"{where} ({count} test(s)): {reason}" for count, where, reason in skipped
                                if (n := re.search(r"needs (\d+) GPU", reason)) and int(n[1]) > gpus]}


def measure(args, name: str, context: int, run: dict, world: int, limit: float) -> dict:
    """One planned run of `mop train` in at most `limit` seconds: the plan and what was measured."""
    limited = argparse.Namespace(**{**vars(args), "timeout": max(1, int(min(args.timeout, limit)))})
    row = isolated(mop_train, limited, name, context, settings(args, world, run["layers"], RUNS[name]))
    result = {"context": context, **run, "command": row["command"], "peak_host_bytes": row["peak_host_bytes"]}
    if row["returncode"] != 0:
        return {**result, "error": row.get("error")}
    last = row["last_record"]
    return {**result, "seconds_per_step": row["seconds_per_step"], "tokens_per_s_per_gpu": row["tokens_per_s_per_rank"],
            "model_tflops_per_s_per_gpu": last.get("model_tflops_per_s_per_rank"), "mfu": last.get("mfu"),
            "peak_device_bytes": max(row["peak_bytes_per_rank"]),
            "optimizer_exposed_s": last.get("optimizer_exposed_s"),
            "device_bytes_per_param": {k: last[f"device_bytes_per_param_{k}"] for k in ("weights", "gradients",
                                                                                        "optimizer")}}


def run(args) -> dict:
    for option, low in (("layers", 0), ("steps", 2), ("budget", 1)):
        if getattr(args, option) < low:
            raise ConfigError(f"--{option}", f"must be >= {low}, got {getattr(args, option)}")
    cluster, device = machine(args)
    plans = plan(args, cluster)
    results = {"device": device, "gpus": cluster.world, "device_bytes": cluster.device_bytes,
               "device_budget_bytes": cluster.budget_bytes, "host_budget_bytes": cluster.host_bytes,
               "host_share": HOST_SHARE, "plans": plans, "failed": []}
    if args.dry_run:
        return results
    deadline = time.monotonic() + args.budget
    results["cuda_tier"] = None if args.skip_tests else isolated(cuda_tier, TIER_SHARE * args.budget, cluster.world)
    for p in (p for p in plans if p["host_optimizer"]):
        host = measure(args, "host_optimizer", p["context"], p["host_optimizer"], cluster.world,
                       (deadline - time.monotonic()) / 2)
        if "error" in host:
            print(f"  {p['context']} tokens: {host['error']}", flush=True)
            results["failed"].append(host)
            continue
        # torch AdamW at this context, or at the longest shorter one where its model fits
        adamw = next((q for q in plans[plans.index(p):] if q["torch_adamw"]), None)
        results.update(host_optimizer=host, torch_adamw=adamw and measure(
            args, "torch_adamw", adamw["context"], adamw["torch_adamw"], cluster.world, deadline - time.monotonic()))
        break
    return results


def report(args, results: dict) -> None:
    gpus = results["gpus"]
    print(f"{results['device'] or 'dry run'}: {gpus} GPU(s), device budget {results['device_budget_bytes'] / GIB:.1f} "
          f"GiB of {results['device_bytes'] / GIB:.1f} per GPU, host budget {results['host_budget_bytes'] / GIB:.1f} "
          f"GiB ({results['host_share']:.0%} of the host's memory); {args.config.name}, bf16")
    rows = [[p["context"], name, *([r["layers"], r["parameters"] / 1e9, r["predicted_peak_device_bytes"] / GIB,
                                    r["predicted_host_bytes"] / GIB, r["layout"]] if (r := p[name]) else
                                   ["does not fit", "", "", "", ""])] for p in results["plans"] for name in RUNS]
    print(table("plan (mop.cost.memory)", ["context", "run", "layers", "params B", "device GiB/GPU", "host GiB",
                                           "layout"], rows))
    if tier := results.get("cuda_tier"):
        print(f"CUDA tier (./mop.sh test -m cuda): {tier['summary']}")
        for line in tier["needs_more_gpus"]:
            print(f"  skipped, more than {gpus} GPU(s): {line}")
    if not args.dry_run and "host_optimizer" not in results:
        print("no context of --contexts trained")
    elif not args.dry_run:
        def gib(r: dict, key: str, predicted: str) -> str:
            return f"{r[key] / GIB:.1f} ({r[predicted] / GIB:.1f})" if key in r else "-"

        rows = [[n, r["context"], r["layers"], r["parameters"] / 1e9, r.get("seconds_per_step", "failed"),
                 r.get("tokens_per_s_per_gpu", "-"), r.get("model_tflops_per_s_per_gpu") or "-", r.get("mfu") or "-",
                 gib(r, "peak_device_bytes", "predicted_peak_device_bytes"),
                 gib(r, "peak_host_bytes", "predicted_host_bytes"), r.get("optimizer_exposed_s") or "-"]
                for n in RUNS if (r := results[n])]
        print(table("measured (predicted); MFU: causal attention counts the keys each query attends; host: the "
                    "largest process's peak resident set", ["run", "context", "layers", "params B", "s/step",
                                                            "tok/s/GPU", "TFLOP/s/GPU", "MFU", "device GiB",
                                                            "host GiB", "optimizer exposed s"], rows))
        host, adamw = results["host_optimizer"], results["torch_adamw"] or {}
        if "seconds_per_step" in adamw and (adamw["layers"], adamw["context"]) == (host["layers"], host["context"]):
            ratio = host["seconds_per_step"] / adamw["seconds_per_step"]
            print(f"step time, host optimizer / torch AdamW: {ratio:.3f}")
        elif "seconds_per_step" in adamw:
            print("torch AdamW ran the model that fits it, not the host optimizer's: compare tokens/s and MFU")
        print(f"device bytes per parameter (host optimizer): {host.get('device_bytes_per_param')}")
    path = write_json(args.out, "gpu", {k: str(v) for k, v in vars(args).items()}, results)
    print(f"results written to {path}")
