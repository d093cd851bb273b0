"""`mop bench optimizer`: the host optimizer's update throughput and how much of it the step exposes.

Part 1, update throughput on the same shards (parameters/s, the median step of `--update-steps`):
`torch.optim.AdamW(fused=True)`, `HostAdamW` updating after the norm is known (the same fused
kernel: `speculative=False`), and `HostAdamW` speculating (backups, worker thread).
Part 2, a training step of a small model on one FSDP2 rank: the update after the backward (torch
AdamW, fused) against the host optimizer, non-speculative ("after norm": every update after the
norm is known, overlapped with the next forward) and speculative, with clipping that never
triggers, on every other step (each clipped step follows a speculated one: a rollback) and on
every step. The rank computes with one intra-op thread, so the optimizer's worker thread has the
machine's other core to itself: the situation of a GPU machine, where the device runs the
backward and the host cores are idle. Every variant is driven through the trainer's optimizer
interface (`mop.optim.optimizer`). Exposed optimizer time is what the step waits for the
optimizer, as the trainer records it: the whole `step()` for torch (norm, clipping, update); for
the host optimizer the wait for the host gradients' norms, `HostAdamW.finish`, and the time the
step's forward waited for the previous step's updates (`GradientFeed.take_wait_s`). "hidden" is
the share of the after-backward optimizer time that the pipelined variant removed. Device memory saved
is the AdamW state torch would keep on the device (moments, 8 bytes per parameter) that now lives
on the host.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from mop.bench.report import MIB, table, write_json
from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from mop.optim.host_adamw import HostAdamW
from mop.optim.optimizer import DeviceAdamW, HostOptimizer, parameter_groups
from mop.testing import run_distributed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=8, help="parameter shards of part 1")
    parser.add_argument("--shard-size", type=int, default=1 << 22, help="elements per shard")
    parser.add_argument("--update-steps", type=int, default=30, help="timed optimizer steps of part 1 (median)")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps of part 2")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/optimizer.json"))


def _shards(count: int, size: int):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(size, generator=g)) for _ in range(count)]


def _update_step(name: str, params, grads):
    """One optimizer step of variant `name` on `params`, as a callable."""
    if name.startswith("torch"):
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

        def step():
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        return step
    host = HostAdamW([{"params": params, "weight_decay": 0.1}], speculative=name.endswith("speculative"))

    def step():
        host.begin_step(1e-3)
        for p, g in zip(params, grads):
            host.gradient_ready(p, g)
        host.finish(0.5, 1.0)
        host.synchronize()
    return step


def update_throughput(args) -> list[dict]:
    """Median step time of each variant; the variants take turns, so drifting machine load hits all alike."""
    names = ("torch AdamW fused", "HostAdamW after norm", "HostAdamW speculative")
    steps, times = {}, {name: [] for name in names}
    for name in names:
        params = _shards(args.shards, args.shard_size)
        steps[name] = _update_step(name, params, [torch.randn_like(p) for p in params])
        steps[name]()  # warm-up
    for _ in range(args.update_steps):
        for name in names:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in names:
        seconds = statistics.median(times[name])
        rows.append({"variant": name, "seconds": seconds, "params_per_s": args.shards * args.shard_size / seconds})
    for row in rows:
        row["vs_torch"] = row["params_per_s"] / rows[0]["params_per_s"]
    return rows


def training_rank(rank: int, world: int, steps: int) -> list[dict]:
    """Part 2 on one FSDP2 rank (so gradients are handed over from FSDP2's post-backward hooks),
    each variant driven through the trainer's optimizer interface (`mop.optim.optimizer`)."""
    from mop.parallel import DistLayout, Layout
    from mop.parallel.fsdp import shard_dense

    cfg = ModelConfig(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=8, expert_intermediate=512)
    ids = torch.randint(0, cfg.vocab_size, (4, 257), generator=torch.Generator().manual_seed(1))
    layout = DistLayout(Layout(world), torch.device("cpu"))
    rows = []
    never, always = (lambda step: 1e9), (lambda step: 1e-3)
    for name, kind, max_norm in [("after backward", "torch", never), ("host, after norm", "host", never),
                                 ("host, speculative", "spec", never),
                                 ("host, speculative, clipped every other step", "spec", lambda step: (1e9, 1e-3)[step % 2]),
                                 ("host, speculative, clipped every step", "spec", always)]:
        model = build_model(cfg, seed=0)
        shard_dense(model, layout)
        groups = parameter_groups(model, 0.0)
        if kind == "torch":
            optimizer = DeviceAdamW(torch.optim.AdamW(groups, lr=1e-4, fused=True), model, layout.world_group,
                                    layout.device, {})
        else:
            optimizer = HostOptimizer(HostAdamW(groups, speculative=kind == "spec"), model, layout.world_group,
                                      layout.device)
        exposed, total, rollbacks, waits = 0.0, 0.0, 0, 0.0
        for step in range(steps + 1):
            start = time.perf_counter()
            optimizer.begin_step(1e-4)
            optimizer.before_forward()
            optimizer.before_backward(last=True)
            model(ids[:, :-1], ids[:, 1:]).backward()
            optimizer.after_backward()
            after_backward = time.perf_counter()
            record = optimizer.step(max_norm(step))
            stepped = time.perf_counter() - after_backward
            rollbacks += record.get("rollback", False) and step > 0
            if step > 0:  # the first step warms up
                exposed += record.get("optimizer_exposed_s", stepped)
                waits += record.get("optimizer_forward_wait_s", 0.0)
                total += time.perf_counter() - start
        optimizer.synchronize()
        optimizer.close()
        count = sum(p.numel() for group in groups for p in group["params"])
        rows.append({"variant": name, "step_s": total / steps, "exposed_s": exposed / steps,
                     "forward_wait_s": waits / steps, "rollback_rate": rollbacks / steps,
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
    print(table("training step (8-block MoE, 1 FSDP2 rank, 1 compute thread)",
                ["variant", "step s", "exposed optimizer s", "of it forward waits", "hidden",
                 "rollback rate", "device state saved MiB"],
                [[r["variant"], r["step_s"], r["exposed_s"], r["forward_wait_s"],
                  r["hidden_vs_after_backward"], r["rollback_rate"],
                  r["device_state_bytes_saved"] / MIB] for r in results["training"]]))
    path = write_json(args.out, "optimizer", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
