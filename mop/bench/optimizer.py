"""`mop bench optimizer`: the host optimizer's update throughput and how much of it the step exposes.

Part 1, update throughput on the same shards (parameters/s, one optimizer step after warm-up):
`torch.optim.AdamW(fused=True)`, `HostAdamW` updating after the norm is known (the same fused
kernel: `speculative=False`), and `HostAdamW` speculating (backups, worker thread).
Part 2, a training step of a small model on one FSDP2 rank: the update after the backward (torch
AdamW, fused) against the host optimizer, non-speculative and speculative, with clipping that
never triggers and with clipping on every step. The rank computes with one intra-op thread, so
the optimizer's worker thread has the machine's other core to itself: the situation of a GPU
machine, where the device runs the backward and the host cores are idle. Exposed optimizer time is
what the step waits for once the gradient norm is known (`optimizer.step()`, or
`HostAdamW.finish`); the norm and clipping, which every variant computes after the backward, are
reported apart. "hidden" is the share of the after-backward optimizer time that the pipelined
variant removed. Device memory saved is the AdamW state
torch would keep on the device (moments, 8 bytes per parameter) that now lives on the host.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mop.bench.report import MIB, table, write_json
from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from mop.optim.host_adamw import HostAdamW
from mop.optim.pipeline import GradientFeed
from mop.testing import run_distributed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=16, help="parameter shards of part 1")
    parser.add_argument("--shard-size", type=int, default=1 << 20, help="elements per shard")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/optimizer.json"))


def _shards(count: int, size: int):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(count)]


def update_throughput(args) -> list[dict]:
    rows = []
    for name in ("torch AdamW fused", "HostAdamW after norm", "HostAdamW speculative"):
        params = _shards(args.shards, args.shard_size)
        grads = [torch.randn_like(p) for p in params]
        if name.startswith("torch"):
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

            def step():
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
        else:
            host = HostAdamW([{"params": params, "weight_decay": 0.1}], speculative=name.endswith("speculative"))

            def step():
                host.begin_step(1e-3)
                for p, g in zip(params, grads):
                    host.gradient_ready(p, g)
                host.finish(0.5, 1.0)
        step()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        seconds = (time.perf_counter() - start) / args.steps
        rows.append({"variant": name, "seconds": seconds, "params_per_s": args.shards * args.shard_size / seconds})
    for row in rows:
        row["vs_torch"] = row["params_per_s"] / rows[0]["params_per_s"]
    return rows


def training_rank(rank: int, world: int, steps: int) -> list[dict]:
    """Part 2 on one FSDP2 rank (so gradients are handed over from FSDP2's post-backward hooks)."""
    from mop.parallel import DistLayout, Layout
    from mop.parallel.fsdp import shard_dense
    from mop.train import Runtime, clip_gradients

    cfg = ModelConfig(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8, expert_intermediate=512)
    ids = torch.randint(0, cfg.vocab_size, (4, 257), generator=torch.Generator().manual_seed(1))
    layout = DistLayout(Layout(world), torch.device("cpu"))
    runtime = Runtime(rank, world, torch.device("cpu"), layout)
    rows = []
    for name, kind, max_norm in [("after backward", "torch", 1e9), ("host, after norm", "host", 1e9),
                                 ("host, speculative", "spec", 1e9), ("host, speculative, clipped", "spec", 1e-3)]:
        model = build_model(cfg, seed=0)
        shard_dense(model, layout)
        params = list(model.parameters())
        if kind == "torch":
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        else:
            host = HostAdamW([{"params": params, "weight_decay": 0.0}], speculative=kind == "spec")
            feed = GradientFeed(model, host)
        exposed, norm_s, total, rollbacks = 0.0, 0.0, 0.0, 0
        for step in range(steps + 1):
            start = time.perf_counter()
            if kind != "torch":
                host.begin_step(1e-4)
                feed.arm()
            model(ids[:, :-1], ids[:, 1:]).backward()
            if kind != "torch":
                feed.flush()
            after_backward = time.perf_counter()
            norm = clip_gradients(model, max_norm if kind == "torch" else 0.0, runtime)
            after_norm = time.perf_counter()
            if kind == "torch":
                opt.step()
            else:
                rollbacks += host.finish(norm, max_norm) and step > 0
            model.zero_grad(set_to_none=True)
            if step > 0:  # the first step warms up
                exposed += time.perf_counter() - after_norm
                norm_s += after_norm - after_backward
                total += time.perf_counter() - start
        count = sum(p.numel() for p in params)
        rows.append({"variant": name, "step_s": total / steps, "exposed_s": exposed / steps,
                     "norm_and_clip_s": norm_s / steps, "rollback_rate": rollbacks / steps,
                     "device_state_bytes_saved": 0 if kind == "torch" else 8 * count})
    for row in rows:
        row["hidden_vs_after_backward"] = 1 - row["exposed_s"] / rows[0]["exposed_s"]
    return rows


def training_steps(args) -> list[dict]:
    return run_distributed(training_rank, 1, args.steps, timeout=600)[0]


def run(args) -> dict:
    return {"update": update_throughput(args), "training": training_steps(args)}


def report(args, results: dict) -> None:
    print(table(f"update throughput, {args.shards} shards x {args.shard_size} fp32 parameters",
                ["variant", "step s", "params/s", "vs torch fused"],
                [[r["variant"], r["seconds"], r["params_per_s"], r["vs_torch"]] for r in results["update"]]))
    print()
    print(table("training step (4-block MoE, 1 FSDP2 rank, 1 compute thread)",
                ["variant", "step s", "norm+clip s", "exposed optimizer s", "hidden", "rollback rate",
                 "device state saved MiB"],
                [[r["variant"], r["step_s"], r["norm_and_clip_s"], r["exposed_s"], r["hidden_vs_after_backward"],
                  r["rollback_rate"],
                  r["device_state_bytes_saved"] / MIB] for r in results["training"]]))
    path = write_json(args.out, "optimizer", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
