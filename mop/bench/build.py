"""`mop bench build`: the resident memory of building a real preset's model on local CPU ranks,
shards only (what `mop train` does) against the full model first (what it did before).

Each rank measures its peak resident size from just before construction to just after
parallelisation (`/proc/self/clear_refs` resets the peak first), for:
- mop: `mop.build.build_model_shards`, `mop train`'s own path: the model constructed on the meta
  device in its storage dtype (bf16 working weights for a bf16 run with the host optimizer, as
  the presets are), parallelised there, then each rank allocates and initialises only its shards;
- full-first, the baseline: `build_model` (the whole fp32 model, initialised) on every rank, then
  the same `parallelize`.
The preset runs with fewer layers (`--layers`) and on `--nproc` ranks with every degree equal to
it, so that the baseline fits this machine; both sides build the same model and layout. The
host optimizer's state (allocated after construction) is not part of either.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mop.bench.report import table, write_json
from mop.build import build_model_shards
from mop.config import load_config
from mop.models.transformer import MoETransformer, build_model
from mop.parallel import DistLayout, Layout
from mop.parallel.parallelize import parallelize
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.memory import ResidentGrowth

GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/qwen3-30b-a3b.toml", help="the preset to build")
    parser.add_argument("--layers", type=int, default=1, help="blocks to build (the preset's count would not fit here)")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (every parallel degree equals it)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/build.json"))


def _measure(rank: int, world: int, config_path: str, settings: list[str], path: str) -> dict:
    config = settle(load_config(config_path, settings), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    with ResidentGrowth() as growth:
        if path == "mop":
            model, _ = build_model_shards(config, Runtime(rank, world, layout.device, layout))
        else:
            model = parallelize(build_model(config.model, config.train.seed), layout, config)
    local = sum((q.to_local() if hasattr(q, "to_local") else q).nbytes for q in model.parameters())
    return {"grown_bytes": growth.bytes, "local_parameter_bytes": local}


def run(args) -> dict:
    n = args.nproc
    settings = [f"--model.layers={args.layers}", "--model.dense_layers=0", f"--parallel.nproc={n}",
                f"--parallel.sequence={n}", f"--parallel.expert={n}", f"--parallel.vocab={n}"]
    config = load_config(args.config, settings)
    with torch.device("meta"):  # shapes only
        model_bytes = 4 * sum(q.numel() for q in MoETransformer(config.model).parameters())
    rows = []
    for path in ("mop", "full-first"):
        per_rank = run_distributed(_measure, n, args.config, settings, path, timeout=1800)
        rows.append({"path": path, "per_rank": per_rank, "worst_grown_bytes": max(r["grown_bytes"] for r in per_rank)})
    results = {"model_fp32_bytes": model_bytes, "rows": rows}
    write_json(args.out, "build", {"config": args.config, "layers": args.layers, "nproc": n,
                                   "train.dtype": config.train.dtype}, results)
    return results


def report(args, results: dict) -> None:
    full = results["model_fp32_bytes"]
    rows = [[r["path"], r["worst_grown_bytes"] / GB, r["worst_grown_bytes"] / full,
             max(x["local_parameter_bytes"] for x in r["per_rank"]) / GB] for r in results["rows"]]
    print(table(f"building {args.config} with {args.layers} layer(s) on {args.nproc} ranks "
                f"(full model {full / GB:.2f} GB in fp32)",
                ["path", "peak growth GB/rank", "x full model", "local parameters GB"], rows))
    print(f"JSON: {args.out}")
