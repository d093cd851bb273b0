"""`mop bench e2e`: training throughput and per-rank memory of mop and of the best fsdp2 setup, against context.

The paper's Table 1 on this machine: W = 2 gloo ranks train one small MoE at contexts doubling from
`--min-context`; at each context every configuration gets a per-rank device memory and, when that
fits `--budget-gib`, a tokens/s. fsdp2-best is the fastest fsdp2 configuration that fits there.

Training. For each configuration and context, `run_distributed` starts two ranks (one intra-op
thread each). Each builds its config with `mop.config.load_config`, every parallel degree and
memory option given explicitly (`base_settings`, then the configuration's own), and its training
run with `mop.build.build_run`, exactly as `mop train` does (model shards, `parallelize` or
`parallelize_fsdp2`, torch AdamW or the host optimizer with its gradient feed), and runs
optimizer steps with the trainer's own `train_step` (which all-reduces the step's target count
and losses, as in `mop train`) and `update`. It differs from `mop train` in two ways: every step
trains the same batches (the step's data is read once) at the constant `optim.lr`, so each
configuration does identical work. fp32, clipping at 1.0.

Data. A step is 2 sequences of S tokens of the shipped corpus (byte tokenizer), packed with
document boundaries exactly as `mop train` packs them and split by the trainer's own
`local_batches`: the same sequences for every configuration, and every configuration (mop and
fsdp2 alike) attends within documents through the same kernel (`mop.models.documents`), never
through an `[S, S]` mask. `--documents single` trains the same tokens as one document per row
(causal attention over the whole row, no document ids); the JSON records which. Without sequence
parallelism each rank trains one sequence. With it (sequence = 2) each rank holds half of both
sequences; fsdp2's "cp" runs them as two micro-batches (S/2 tokens per rank per forward: CP
with both in one micro-batch holds S tokens per rank, like fsdp2 without CP, and only adds the
all-to-alls, so it is never the best and is not swept), mop as one micro-batch (S tokens per rank).
At 64K and more the corpus (150K tokens) holds fewer sequences than a step needs and the packed
stream repeats them: the work per step is the same.

Configurations. Each system is swept over its own memory options and, per context, its fastest
configuration that fits is reported (mop-best against fsdp2-best), so neither side is judged by a
setting that is only right at one context.
- mop: Ulysses (sequence = 2, `--head-chunks`), LLEP (expert = 2), the vocabulary-parallel ring
  loss (vocab = 2, `--token-block` tokens per logit tile) and the host optimizer, with the options
  of `MOP_OPTIONS` (`--mop-configs`): full activation checkpointing ("ac"), the checkpointed block
  inputs offloaded to the host ("offload"), LLEP in `--llep-chunks` token chunks ("chunked") and the
  ring's logit tiles kept for the backward instead of recomputed ("kept").
  The default sweeps "plain" (fastest, most memory), "ac" and "ac+offload+chunked" (leanest).
  Measured at 16K on the default model, per rank, with ac+offload (before the tracker counted
  FSDP2's gathered weights, which add about 10 MiB to each): 349 MiB unchunked, 311 MiB with
  2 LLEP chunks, 237 MiB with 4; 2 head chunks on top save 8 MiB for 15% more time. So the lean
  setup uses 4 LLEP chunks and unchunked attention; one micro-batch of both sequences was ~20%
  faster than two at 2K.
- fsdp2: every combination of the options in `FSDP2_OPTIONS` (`--fsdp2-configs=all`, 16 setups):
  activation checkpointing ("ac"), FSDP2's CPUOffloadPolicy ("offload"), Ulysses context
  parallelism ("cp") and standard expert parallelism ("ep").

Model and budget (the defaults). A 4-block MoE, hidden 128, 8 experts of width 256 (top 2), GQA
4/2 heads of 32, vocabulary 16K (vocabulary/hidden 128; Qwen3-30B-A3B's is 74): a size whose 16K
context steps take about 30 s on two cores (the default run takes about 10 minutes). The budget,
0.29 GiB per rank, is this model's stand-in for an H200: the paper's runs are limited by
activations, not by model state, and 0.29 GiB is about 5x plain fsdp2's model state (parameters,
gradients and AdamW moments: 57 MiB). Memory is deterministic (only the times are noisy), but since
the tracker counts FSDP2's gathered weights (issue 18) two fsdp2 setups at 2K sit close under it:
offload+cp at 284 MiB (4% under) and offload+cp+ep at 293 MiB (1% under); every other decision at
2K-4K is at least 8% away from it.

Per-rank device memory. There is no accelerator here, so the device memory a GPU would need is
computed from the tensors the step really allocates:
- persistent state, read from the tensors: the rank's parameter shards (0 under CPUOffloadPolicy,
  which keeps them on the host) and the optimizer state (torch AdamW's moments, 8 bytes per
  parameter, on the device; 0 for mop's host optimizer and under CPUOffloadPolicy);
- plus the transient peak of one training step after a warm-up step, from
  `mop.testing.memory.PeakMemory`: every tensor the step creates, while it lives (activations,
  FSDP2's gathered weights (in storages it resizes in place, which the tracker follows),
  communication buffers, and gradients, which live from the backward until the update releases
  them), less what a GPU machine holds in host memory: the offloaded block inputs (the
  `HostOffload` store's live bytes), under CPUOffloadPolicy the gradient shards FSDP2 moves to the
  host after each reduce-scatter (`mop.testing.step.HostGradients`), and the gradients the host optimizer holds as
  handed over (lent to it on this machine, copied to the host on a GPU). The update is inside the
  measured region only when the optimizer steps on the device (torch AdamW without offload).
On a GPU the transient peak is what `torch.cuda.max_memory_allocated` reports (`PeakMemory`'s CUDA
path); here the ranks run on the CPU. One device copy is not seen here: under CPUOffloadPolicy a
GPU first copies a unit's parameter shard to the device for its all-gather (a small undercount
for fsdp2's offload setups). The worst rank is reported. A configuration is OOM at S when this
exceeds the budget: it is not timed there and not run at longer contexts (its memory only grows
with S). The sweep stops after the context where every mop configuration is OOM, or at
`--max-context`.

Throughput: tokens per second per rank (2 S / W / step time, the paper's tokens/s/GPU), from the
median wall time of `--steps` steps after the warm-up and memory steps, slowest rank. Both ranks
share this machine's two cores, and its load drifts: one configuration measured twice minutes
apart has differed by 20-40%. So the speed target is judged by a rematch: at the longest context
both fit, mop-best and fsdp2-best are measured `--rounds` more times each, taking turns, and
their medians compared. Nothing overlaps with compute here as it would on a GPU: the host
optimizer's thread, the offload copies and the collectives all take the same two cores; and
FSDP2's CPUOffloadPolicy costs no transfer time here (host and device are the same memory),
where on a GPU it copies every parameter and gradient shard over PCIe each step.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import add_shape_arguments
from mop.config import ConfigError, load_config
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.step import Trainer, step_memory

GIB = 2**30
WORLD = 2
SEQUENCES = 2  # per optimizer step, for every configuration

# Each mop memory option, as the settings it changes from mop's fastest form ("plain": no activation
# checkpointing, LLEP in one chunk). "chunked" splits LLEP into --llep-chunks chunks.
MOP_OPTIONS = {
    "ac": ["--train.activation_checkpointing=full"],
    "offload": ["--train.offload_activations=true"],
    "chunked": [],  # filled in from --llep-chunks by mop_variant
    "kept": ["--parallel.vocab_logits=keep"],  # the ring's logit tiles kept for the backward
}
MOP_DEFAULT = "plain,ac,ac+offload+chunked"

# Each fsdp2 option, as the settings it changes from plain fsdp2.
FSDP2_OPTIONS = {
    "ac": ["--train.activation_checkpointing=full"],
    "offload": ["--parallel.fsdp_cpu_offload=true"],
    "cp": ["--parallel.sequence=2"],
    "ep": ["--parallel.expert=2"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget-gib", type=float, default=0.29, help="per-rank device memory budget")
    parser.add_argument("--min-context", type=int, default=2048, help="first context; doubled up to --max-context")
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--mop-configs", default=MOP_DEFAULT,
                        help="comma-separated mop setups, each 'plain' or '+'-joined options of "
                             f"{', '.join(MOP_OPTIONS)} ('offload' needs 'ac')")
    parser.add_argument("--fsdp2-configs", default="all",
                        help="comma-separated fsdp2 setups, each 'plain' or '+'-joined options of "
                             f"{', '.join(FSDP2_OPTIONS)}; 'all': every combination")
    add_shape_arguments(parser, vocab=16384, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=8,
                        intermediate=256)
    parser.add_argument("--head-chunks", type=int, default=1, help="mop's attention head chunks")
    parser.add_argument("--llep-chunks", type=int, default=4, help="mop's expert token chunks")
    parser.add_argument("--token-block", type=int, default=1024, help="tokens per logit tile of mop's ring loss")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per point (median), after a warm-up and a memory step")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rematches of mop-best and fsdp2-best at the longest context both fit (median)")
    parser.add_argument("--documents", choices=["packed", "single"], default="packed",
                        help="packed: the shipped corpus packed with document masks, as mop train trains; "
                             "single: the same tokens as one document per row (pure causal attention)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/e2e.json"), help="JSON; the PNG goes beside it")


@dataclass(frozen=True)
class Variant:
    """One configuration of the sweep: its name and the settings that make it."""

    name: str
    settings: tuple[str, ...]


def base_settings(args) -> list[str]:
    """The model and everything a configuration does not change, spelled out: no default decides the layout."""
    return [f"--model.vocab_size={args.vocab}", f"--model.hidden={args.hidden}", f"--model.layers={args.layers}",
            f"--model.heads={args.heads}", f"--model.kv_heads={args.kv_heads}", f"--model.head_dim={args.head_dim}",
            f"--model.experts={args.experts}", "--model.top_k=2", f"--model.expert_intermediate={args.intermediate}",
            f"--parallel.nproc={WORLD}", "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
            "--parallel.expert_balance=ep", "--parallel.llep_chunks=1", "--parallel.llep_min_chunk=1024",
            "--parallel.attention_head_chunks=1", "--parallel.vocab_token_block=0", "--parallel.vocab_logits=keep",
            "--parallel.fsdp_cpu_offload=false",
            "--train.activation_checkpointing=none", "--train.offload_activations=false", "--optim.offload=false",
            f"--train.global_batch={SEQUENCES}", "--train.micro_batch=1", "--train.dtype=float32",
            "--train.grad_clip=1.0", "--train.device=cpu", "--train.seed=0", "--data.source=builtin",
            "--data.tokenizer=byte"]


def _options(name: str, known: dict, kind: str) -> list[str]:
    options = [] if name == "plain" else name.split("+")
    unknown = [o for o in options if o not in known]
    if unknown:
        raise ConfigError(f"--{kind}-configs", f"unknown option {unknown[0]!r} in {name!r}; use 'plain' or "
                                               f"'+'-joined options of {', '.join(known)}")
    return options


def mop_variant(args, name: str) -> Variant:
    """mop's full layout (Ulysses, LLEP, the vocabulary-parallel loss, the host optimizer) with `name`'s options."""
    options = _options(name, MOP_OPTIONS, "mop")
    chosen = {**MOP_OPTIONS, "chunked": [f"--parallel.llep_chunks={args.llep_chunks}"]}
    settings = ["--parallel.strategy=mop", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
                "--parallel.expert_balance=llep", f"--parallel.attention_head_chunks={args.head_chunks}",
                f"--parallel.vocab_token_block={args.token_block}", "--parallel.vocab_logits=recompute",
                f"--train.micro_batch={SEQUENCES}",
                "--optim.offload=true", *itertools.chain.from_iterable(chosen[o] for o in options)]
    return Variant(f"mop {name}", tuple(settings))


def fsdp2_variant(name: str) -> Variant:
    options = _options(name, FSDP2_OPTIONS, "fsdp2")
    settings = ["--parallel.strategy=fsdp2", *itertools.chain.from_iterable(FSDP2_OPTIONS[o] for o in options)]
    return Variant(f"fsdp2 {name}", tuple(settings))


def fsdp2_names(spec: str) -> list[str]:
    if spec != "all":
        return spec.split(",")
    combos = (itertools.combinations(FSDP2_OPTIONS, size) for size in range(1, len(FSDP2_OPTIONS) + 1))
    return ["plain", *("+".join(c) for c in itertools.chain.from_iterable(combos))]


def measure_rank(rank: int, world: int, settings: list[str], documents: str, budget_bytes: int, steps: int) -> dict:
    """A warm-up step, a memory step, then `steps` timed steps if the worst rank fits the budget."""
    trainer = Trainer(settle(load_config(None, settings), world, fit_memory=False), rank, documents)
    result = step_memory(trainer)
    worst = torch.tensor(result["device"])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    result.update(fits=worst.item() <= budget_bytes, seconds=None)
    if result["fits"]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.step()
            trainer.run.optimizer.synchronize()  # the host optimizer's deferred updates count too
            times.append(time.perf_counter() - start)
        result["seconds"] = statistics.median(times)
    return result


def measure(args, variant: Variant, context: int) -> dict:
    """One configuration at one context: the worst rank's memory, the slowest rank's time."""
    settings = [*base_settings(args), f"--data.seq_len={context}", *variant.settings]
    per_rank = run_distributed(measure_rank, WORLD, settings, args.documents, int(args.budget_gib * GIB), args.steps,
                               timeout=3600)
    worst = max(per_rank, key=lambda r: r["device"])
    seconds = max(r["seconds"] for r in per_rank) if worst["fits"] else None
    return {"config": variant.name, "context": context, **worst, "seconds": seconds,
            "tokens_per_s_per_rank": SEQUENCES * context / WORLD / seconds if seconds else None}


def contexts(args) -> list[int]:
    return [args.min_context * 2**i for i in range((args.max_context // args.min_context).bit_length())]


def sweep(args, variants: list[Variant]) -> list[dict]:
    """Every configuration at doubling contexts until it is OOM; stops after the context where every mop one is."""
    rows, running = [], {v.name for v in variants}
    for context in contexts(args):
        for variant in (v for v in variants if v.name in running):
            row = measure(args, variant, context)
            rows.append(row)
            speed = f"{row['tokens_per_s_per_rank']:8.1f} tok/s/rank" if row["fits"] else "OOM"
            print(f"  S={context:<6} {variant.name:<28} {row['device'] / MIB:8.1f} MiB  {speed}", flush=True)
            if not row["fits"]:
                running.discard(variant.name)
        if not any(is_mop(name) for name in running):
            break
    return rows


def is_mop(name: str) -> bool:
    return name.startswith("mop ")


def fastest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["tokens_per_s_per_rank"], default=None)


def summary(rows: list[dict]) -> list[dict]:
    """Table 1's rows: per context, the fastest mop configuration that fits against the fastest fsdp2 one."""
    out = []
    for context in dict.fromkeys(r["context"] for r in rows):
        fitting = [r for r in rows if r["context"] == context and r["fits"]]
        mop = fastest([r for r in fitting if is_mop(r["config"])])
        fsdp2 = fastest([r for r in fitting if not is_mop(r["config"])])
        mop_speed, fsdp2_speed = (r["tokens_per_s_per_rank"] if r else None for r in (mop, fsdp2))
        out.append({"context": context, "mop_best": mop["config"] if mop else None, "mop_best_tokens_per_s": mop_speed,
                    "fsdp2_best": fsdp2["config"] if fsdp2 else None, "fsdp2_best_tokens_per_s": fsdp2_speed,
                    "speedup": mop_speed / fsdp2_speed if mop_speed and fsdp2_speed else None})
    return out


def rematch(args, variants: list[Variant], table1: list[dict]) -> dict | None:
    """mop-best against fsdp2-best at the longest context both fit, measured again `--rounds` times
    each, taking turns, so that drifting machine load does not decide the comparison; medians."""
    common = [r for r in table1 if r["speedup"] is not None]
    if not common:
        return None
    row, by_name = common[-1], {v.name: v for v in variants}
    speeds = {row["mop_best"]: [], row["fsdp2_best"]: []}
    for _ in range(args.rounds):
        for name in speeds:
            speeds[name].append(measure(args, by_name[name], row["context"])["tokens_per_s_per_rank"])
    mop, fsdp2 = (statistics.median(speeds[row[key]]) for key in ("mop_best", "fsdp2_best"))
    return {"context": row["context"], "mop_best": row["mop_best"], "fsdp2_best": row["fsdp2_best"],
            "mop_tokens_per_s": speeds[row["mop_best"]], "fsdp2_tokens_per_s": speeds[row["fsdp2_best"]],
            "speedup": mop / fsdp2}


def targets(args, table1: list[dict], head_to_head: dict | None) -> dict:
    """Issue 7's targets: mop trains at 8x fsdp2-best's longest context; where both fit, mop-best is
    as fast (judged by the rematch's medians)."""
    fsdp2_longest = max((r["context"] for r in table1 if r["fsdp2_best"]), default=None)
    mop_longest = max((r["context"] for r in table1 if r["mop_best"]), default=None)
    ratio = mop_longest / fsdp2_longest if mop_longest and fsdp2_longest else None
    speedup = head_to_head["speedup"] if head_to_head else None
    return {"fsdp2_best_longest_context": fsdp2_longest, "mop_longest_context": mop_longest,
            "mop_stopped_by_max_context": mop_longest == contexts(args)[-1], "context_ratio": ratio,
            "context_target_met": ratio is not None and ratio >= 8,
            "longest_common_context": head_to_head["context"] if head_to_head else None,
            "speedup_at_longest_common_context": speedup, "speedup_target_met": speedup is not None and speedup >= 1}


def configurations(args) -> list[Variant]:
    """Every configuration to sweep, each checked against the config loader here, before any rank starts."""
    chosen = [*(mop_variant(args, name) for name in args.mop_configs.split(",")),
              *(fsdp2_variant(name) for name in fsdp2_names(args.fsdp2_configs))]
    for variant in chosen:
        try:
            settle(load_config(None, [*base_settings(args), f"--data.seq_len={args.min_context}", *variant.settings]), fit_memory=False)
        except ConfigError as err:
            kind, name = variant.name.split(" ", 1)
            raise ConfigError(f"--{kind}-configs", f"{name!r} makes an invalid config ({err})") from None
    return chosen


def run(args) -> dict:
    chosen = configurations(args)
    rows = sweep(args, chosen)
    table1 = summary(rows)
    head_to_head = rematch(args, chosen, table1)
    return {"documents": args.documents, "configs": {v.name: list(v.settings) for v in chosen}, "points": rows,
            "table1": table1,
            "rematch": head_to_head, "targets": targets(args, table1, head_to_head)}


def plot(path: Path, rows: list[dict], budget_gib: float) -> Path:
    """Per-rank device memory (with the budget) and tokens/s per rank against context, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, speed) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors, mop_lines = plt.get_cmap("tab20").colors, ["-", "--", ":"]
    for index, name in enumerate(dict.fromkeys(r["config"] for r in rows)):
        mine = [r for r in rows if r["config"] == name]
        style = {"linewidth": 3, "color": "black", "zorder": 3, "linestyle": mop_lines[index % 3]} if is_mop(name) \
            else {"linewidth": 1, "color": colors[index % len(colors)]}
        memory.plot([r["context"] for r in mine], [r["device"] / MIB for r in mine], marker="o", label=name, **style)
        timed = [r for r in mine if r["fits"]]
        speed.plot([r["context"] for r in timed], [r["tokens_per_s_per_rank"] for r in timed], marker="o", **style)
    memory.axhline(budget_gib * GIB / MIB, color="red", linestyle="--", label="budget")
    measured = sorted({r["context"] for r in rows})
    labels = ((memory, "per-rank device memory (MiB)"), (speed, "tokens/s per rank (configurations that fit)"))
    for axis, label in labels:
        axis.set_xscale("log", base=2)
        axis.set_xticks(measured, [f"{c // 1024}K" if c >= 1024 else str(c) for c in measured])
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    memory.set_yscale("log")
    speed.set_ylim(bottom=0)
    fig.legend(loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cell(value):
    return "-" if value is None else value


def report(args, results: dict) -> None:
    print(table(f"tokens/s per rank, W={WORLD}, budget {args.budget_gib:g} GiB per rank, {args.documents} documents "
                "(the paper's Table 1)",
                ["context", "mop-best", "mop-best config", "fsdp2-best", "fsdp2-best config", "speedup"],
                [[r["context"], r["mop_best_tokens_per_s"] or "OOM", _cell(r["mop_best"]),
                  r["fsdp2_best_tokens_per_s"] or "OOM", _cell(r["fsdp2_best"]), _cell(r["speedup"])]
                 for r in results["table1"]]))
    print()
    print(table("every configuration: per-rank device MiB (step peak includes the gradients); persistent device "
                "bytes per parameter (weights, optimizer state and gradients kept between steps)",
                ["context", "config", "params", "optimizer", "B/param", "step peak", "of it grads", "device",
                 "tok/s/rank", "fits"],
                [[r["context"], r["config"], r["parameters"] / MIB, r["optimizer_state"] / MIB,
                  r.get("device_bytes_per_param", "-"), r["step_peak"] / MIB, r["gradients"] / MIB, r["device"] / MIB,
                  _cell(r["tokens_per_s_per_rank"]), "yes" if r["fits"] else "OOM"] for r in results["points"]]))
    t = results["targets"]
    mop_longest = f"{t['mop_longest_context']}{' (--max-context)' if t['mop_stopped_by_max_context'] else ''}"
    print(f"\nlongest context that fits: fsdp2-best {t['fsdp2_best_longest_context']}, mop {mop_longest}: "
          f"{_cell(t['context_ratio'])}x (target 8x: {'met' if t['context_target_met'] else 'NOT met'})")
    match = results["rematch"]
    if match:
        print(f"rematch at {match['context']}, {args.rounds} rounds taking turns (tokens/s per rank): "
              f"{match['mop_best']} {', '.join(f'{v:.1f}' for v in match['mop_tokens_per_s'])}; "
              f"{match['fsdp2_best']} {', '.join(f'{v:.1f}' for v in match['fsdp2_tokens_per_s'])}")
    print(f"mop-best / fsdp2-best tokens/s at the longest context both fit ({t['longest_common_context']}), "
          f"medians of the rematch: {_cell(t['speedup_at_longest_common_context'])} "
          f"(target 1: {'met' if t['speedup_target_met'] else 'NOT met'})")
    path = write_json(args.out, "e2e", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path} and {plot(args.out.with_suffix('.png'), results['points'], args.budget_gib)}")
