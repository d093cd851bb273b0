"""`mop bench vocab`: the output projection + loss, per rank, for four ways of computing it.

- full: full logits `[N, V]` and `F.cross_entropy` (what a plain training loop does);
- tiled: tokens in blocks against the whole weight, each block recomputed in the backward: mop's
  one-rank head (`mop.parallel.vocab.TiledHead`, what `parallel.vocab_logits = "recompute"` at P = 1
  runs; Liger's fused linear cross-entropy and Cut Cross-Entropy do the same: no full logits, whole
  weight);
- ring: mop's vocabulary-parallel ring loss, the weight's rows sharded over P ranks, each logit tile
  formed again in the backward (`parallel.vocab_logits = "recompute"`);
- ring-kept: the same ring keeping the forward's tiles for the backward (`"keep"`): one GEMM fewer,
  the rank's `[N, V]` fp32 logits held; skipped where those exceed --max-logits-gib, as full is.

Then issue 50's two fixes of the ring on a CPU, each against what it replaced: the same ranks take,
in turn, a step of the ring as mop runs it and a step with one fix undone, `--fix-repeats` steps
each, so that all see the same moments of a noisy machine; the table gives each one's median step
(slowest rank) and the ratio. The fixes (results bit for bit the same: tests/test_vocab.py):
- cache-sized passes: a tile's elementwise passes about `CPU_PASS_BYTES` of its rows at a time,
  against each pass over the whole tile (`Ring.pass_bytes = None`);
- the tile buffer: a recomputing ring's tiles all formed in one buffer, against a tile allocated
  per block (`Ring.tile_buffer = False`). It matters under glibc's default heap, where a 64 MiB
  tile is mmapped afresh each time, so the recomputing ring is measured under both heaps: the one
  that keeps freed memory (what `mop train` sets while memory allows) and the default (what the fit
  leaves when memory is tight). A ring keeping its tiles has no buffer.

Every rank runs its own N tokens (W ranks, one intra-op thread each). Memory per rank = the
weight it holds + the transient peak of forward + backward (`mop.testing.memory`: the weight's
gradient, the logit tiles, the ring's incoming shard and gradient buffers). Communication per rank
is counted from the algorithm: the ring sends (P-1) weight shards forward and (P-1) shards plus P
fp32 gradient buffers backward; full and tiled need the whole weight's gradient reduced across
the W data-parallel ranks (plus the weight gathered, under FSDP2), counted as 2 (W-1)/W x the
weight's bytes. The full-logits variant is skipped (not run) where its logits alone would exceed
--max-logits-gib (it needs about four times that per rank); a variant whose rank the kernel kills
(out of memory) is reported as killed, and the others still run. Ratios are against "full" where
it ran, else against "tiled".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mop.bench.report import MIB, table, write_json
from mop.models.config import ModelConfig
from mop.models.transformer import LMHead
from mop.parallel import DistLayout, Layout
from mop.parallel.vocab import TiledHead, VocabParallelHead, default_token_block
from mop.runtime import keep_freed_host_memory
from mop.testing import DistributedError, run_distributed
from mop.testing.memory import measure_step

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks; the ring runs with P = world")
    parser.add_argument("--tokens", default="2048,8192", help="tokens per rank, comma-separated (up to 32768)")
    parser.add_argument("--vocabs", default="32768,131072,262144", help="vocabulary sizes, comma-separated")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--max-logits-gib", type=float, default=1.0, help="skip full logits larger than this")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fix-repeats", type=int, default=6,
                        help="steps of the ring as mop runs it and with each fix undone, taken in turn "
                             "(0: no comparison of the fixes)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/vocab.json"))


def logits_fit(args, tokens: int, vocab: int) -> bool:
    """Whether a rank's full fp32 logits (the full variant's, the kept ring's) fit --max-logits-gib."""
    return tokens * vocab * 4 <= args.max_logits_gib * GIB


def rank_problem(rank: int, tokens: int, vocab: int, hidden: int, keep_heap: bool = True):
    """This rank's heap set as `mop train`'s where memory allows (`train.keep_freed_host_memory`; with
    `keep_heap` off, glibc's default, as where memory is tight), and its problem: the head (the same on
    every rank), its hidden states and its targets."""
    if keep_heap:
        keep_freed_host_memory()
    head = LMHead(ModelConfig(vocab_size=vocab, hidden=hidden))
    torch.nn.init.normal_(head.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    return head, h, torch.randint(0, vocab, (tokens,), generator=g)


def ring_head(head: LMHead, world: int, keep_logits: bool) -> VocabParallelHead:
    """The ring over all `world` ranks (P = W), its tiles of the automatic size, no z-loss."""
    return VocabParallelHead(head, DistLayout(Layout(world, vocab=world), torch.device("cpu")), 0, 0.0, keep_logits)


def loss_rank(rank, world, variant: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    head, h, labels = rank_problem(rank, tokens, vocab, hidden)
    if variant.startswith("ring"):
        module = ring_head(head, world, keep_logits=variant == "ring-kept")
        loss_fn = module.loss_sum
        head = None  # the full weight is not kept
    elif variant == "tiled":
        module = TiledHead(head, default_token_block(vocab))
        loss_fn = module.loss_sum
    else:
        module = head
        loss_fn = lambda h, y: F.cross_entropy(head(h).float(), y, reduction="sum")  # noqa: E731
    weight = module.weight

    def step():
        weight.grad = None
        loss_fn(h, labels).backward()

    measured = measure_step(step, repeats)
    weight_bytes = weight.numel() * weight.element_size()
    return {"seconds": measured["seconds"], "peak_bytes": weight_bytes + measured["peak_bytes"],
            "weight_bytes": weight_bytes}


# each fix of the ring on a CPU: the ring with it undone
UNDONE = {"whole-tile passes": {"pass_bytes": None}, "tile per block": {"tile_buffer": False}}


def fixes_rank(rank, world, keep_logits: bool, keep_heap: bool, tokens: int, vocab: int, hidden: int,
               repeats: int) -> dict:
    """Seconds of ring steps (forward + backward, between barriers) as mop runs them and with each fix
    undone that applies (a kept ring has no tile buffer), taken in turn."""
    head, h, labels = rank_problem(rank, tokens, vocab, hidden, keep_heap)
    module = ring_head(head, world, keep_logits)
    rings = {"mop": module.ring} | {name: dataclasses.replace(module.ring, **undo) for name, undo in UNDONE.items()
                                    if not (keep_logits and "tile_buffer" in undo)}
    seconds = {name: [] for name in rings}
    for turn in range(repeats + 1):  # the first turn warms up every ring
        for name in (rings if turn % 2 else reversed(rings)):
            module.ring, module.weight.grad, h.grad = rings[name], None, None
            dist.barrier()
            start = time.perf_counter()
            module.loss_sum(h, labels).backward()
            dist.barrier()
            if turn:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def compare_fixes(args, vocab: int, tokens: int) -> list[dict]:
    """The ring against each fix undone: recomputing under both heaps, and keeping (under the heap that
    keeps freed memory) where its logits fit --max-logits-gib."""
    rows = []
    for keep_logits, keep_heap in ((False, True), (False, False), (True, True)):
        if keep_logits and not logits_fit(args, tokens, vocab):
            continue
        per_rank = run_distributed(fixes_rank, args.world, keep_logits, keep_heap, tokens, vocab, args.hidden,
                                   args.fix_repeats, timeout=3600)
        steps = {name: [max(turn) for turn in zip(*(r[name] for r in per_rank))] for name in per_rank[0]}
        median = {name: statistics.median(s) for name, s in steps.items()}
        rows.append({"vocab": vocab, "tokens": tokens, "ring": "ring-kept" if keep_logits else "ring",
                     "heap": "kept" if keep_heap else "default", "median_s": median,
                     "speedup": {name: median[name] / median["mop"] for name in median if name != "mop"},
                     "steps_s": steps})
    return rows


def communicated_bytes(variant: str, world: int, vocab: int, hidden: int) -> int:
    full_weight = vocab * hidden * 4
    if variant.startswith("ring"):
        shard = math.ceil(vocab / world) * hidden * 4
        return (world - 1) * shard + (world - 1) * shard + world * shard
    return int(2 * (world - 1) / world * full_weight)


def run(args) -> dict:
    rows, fixes = [], []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for tokens in (int(n) for n in args.tokens.split(",")):
            base = None
            for variant in ("full", "tiled", "ring", "ring-kept"):
                if variant in ("full", "ring-kept") and not logits_fit(args, tokens, vocab):
                    rows.append({"vocab": vocab, "tokens": tokens, "variant": variant, "skipped": True,
                                 "logits_bytes": tokens * vocab * 4})
                    continue
                try:
                    per_rank = run_distributed(loss_rank, args.world, variant, tokens, vocab, args.hidden,
                                               args.repeats, timeout=3600)
                except DistributedError as error:
                    if not error.killed:
                        raise
                    rows.append({"vocab": vocab, "tokens": tokens, "variant": variant, "skipped": False,
                                 "killed": error.killed})
                    continue
                result = {"seconds": max(r["seconds"] for r in per_rank),
                          "peak_bytes": max(r["peak_bytes"] for r in per_rank),
                          "bytes_sent": communicated_bytes(variant, args.world, vocab, args.hidden)}
                base = base or result
                rows.append({"vocab": vocab, "tokens": tokens, "variant": variant, "skipped": False, **result,
                             "peak_vs_base": result["peak_bytes"] / base["peak_bytes"],
                             "time_vs_base": result["seconds"] / base["seconds"]})
            if args.fix_repeats:
                fixes += compare_fixes(args, vocab, tokens)
    return {"rows": rows, "fixes": fixes}


def _cells(row: dict) -> list:
    if row["skipped"]:
        return ["skipped: logits alone need", f"{row['logits_bytes'] / GIB:.1f} GiB", "", "", ""]
    if "killed" in row:
        signals = ", ".join(f"rank {rank}: signal {signal}" for rank, signal in row["killed"].items())
        return [f"killed ({signals}; out of memory?)", "lower --max-logits-gib", "", "", ""]
    return [row["peak_bytes"] / MIB, row["peak_vs_base"], row["seconds"], row["time_vs_base"], row["bytes_sent"] / MIB]


def report(args, results: dict) -> None:
    print(table(f"output projection + loss, forward + backward, per rank, W=P={args.world}, H={args.hidden}",
                ["V", "N/rank", "variant", "peak MiB", "vs base", "time s", "vs base", "sent MiB"],
                [[r["vocab"], r["tokens"], r["variant"], *_cells(r)] for r in results["rows"]]))
    if results["fixes"]:
        print()
        undone = list(UNDONE)
        columns = [c for name in undone for c in (f"{name} s", "x")]
        print(table(f"the ring's fixes on a CPU, forward + backward, median of {args.fix_repeats} steps each, "
                    "taken in turn (x: time with the fix undone / as mop runs)",
                    ["V", "N/rank", "ring", "heap", "as mop runs s", *columns],
                    [[r["vocab"], r["tokens"], r["ring"], r["heap"], r["median_s"]["mop"]]
                     + [c for name in undone for c in ((r["median_s"][name], r["speedup"][name])
                                                         if name in r["speedup"] else ("n/a", ""))]
                     for r in results["fixes"]]))
    path = write_json(args.out, "vocab", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
