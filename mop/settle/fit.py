"""`mop train` fits the settings left automatic to the memory a rank has (`train.memory_budget`).

Searched axes, each only where the user left it automatic (a value written in the config or on the
command line is kept, and the rest are searched around it): the degrees D, Ep and P, attention head
chunks, LLEP chunks, the logits kept or recomputed tile by tile (`parallel.vocab_logits`, with any
number of vocabulary ranks), activation checkpointing and its offload, and the micro-batch (up
to 4 sequences; the global batch is the user's). `fit_to_memory` decides them, from the plain rules'
config (`mop.settle.rules`):
1. today's layout (each automatic setting's plain rule: the largest degrees, no chunks, no
   checkpointing, the logits kept, 4 sequences per micro-batch) is kept when the memory model
   (`mop.cost`) says it fits the budget: nothing changes for a run that fits;
2. otherwise every combination of the automatic axes is built as a real config, validated as
   `mop train` validates it, and scored by the planner (`mop.cost.candidates.evaluate`: the memory
   model and the roofline, on `mop.cost.cluster.local_cluster`, which on a CPU computes at the rate
   the ranks' matmul probe measured); the fastest that fits runs (of those within the roofline's
   resolution, the one needing the least memory);
3. nothing fits: one line naming the budget, the closest layout's need and what to change.
`train.keep_freed_host_memory` left "auto" is decided with the layout: each rank's heap keeps what it
frees (faster on a CPU, but its holes stay resident) only while the chosen layout's predicted need
is at most `HEAP_SHARE` of the budget.
On the CPU host and device are one memory: a rank's host bytes (the host optimizer's state) count
against the budget, and activation offload, which only moves bytes within it, is not searched.

The choice is recorded (`mop.settle.resolved.FitRecord`) in the resolved config, so the start line
prints it and the run's config.json keeps it. Every rank settles the same settings: the budget is
the smallest rank's (`MemoryLimits.smallest_over_ranks`, with the host memory) and the search is
deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from mop.config import Config, ConfigError
from mop.cost.candidates import Candidate, choose, describe, divisors, evaluate, over
from mop.cost.cluster import GIB, local_cluster
from mop.parallel.mesh import LayoutError
from mop.runtime import visible_gpus
from mop.settle.budget import MemoryLimits
from mop.settle.resolved import FitRecord, ResolvedConfig
from mop.settle.rules import MOST_SEQUENCES_PER_MICRO_BATCH, check_resolved

# axis -> (section, field) of the setting it decides
AXES = {"sequence": ("parallel", "sequence"), "expert": ("parallel", "expert"), "vocab": ("parallel", "vocab"),
        "head_chunks": ("parallel", "attention_head_chunks"), "llep_chunks": ("parallel", "llep_chunks"),
        "vocab_logits": ("parallel", "vocab_logits"), "checkpointing": ("train", "activation_checkpointing"),
        "offload": ("train", "offload_activations"), "micro_batch": ("train", "micro_batch")}
# A heap that keeps what it frees holds its holes too: measured up to 1.75x the memory model's need
# (128K, LLEP in 16 chunks), so it is kept only while the need is at most half the budget.
HEAP_SHARE = 0.5
CHUNKS = (1, 2, 4, 8, 16)  # `mop plan`'s, and 16: long contexts on few ranks want fine LLEP chunks


def automatic_axes(config: Config) -> tuple[str, ...]:
    """The searched axes the raw `config` leaves automatic (0 or "auto")."""
    def automatic(value) -> bool:
        return value == "auto" or (type(value) is int and value == 0)  # not False, which equals 0

    return tuple(axis for axis, (section, name) in AXES.items() if automatic(getattr(getattr(config, section), name)))


def fit_to_memory(decided: ResolvedConfig, axes: tuple[str, ...], limits: MemoryLimits,
                  heap_automatic: bool = False) -> ResolvedConfig:
    """`decided` (the plain rules' config) with its automatic `axes` fitted to `limits` (module
    docstring); as it is outside "mop", without automatic axes or without a budget. With
    `heap_automatic` (`train.keep_freed_host_memory` left "auto"), freed host blocks are kept only
    while the chosen layout's predicted need is at most `HEAP_SHARE` of the budget."""
    if decided.parallel.strategy != "mop" or not axes or limits.budget_bytes is None:
        return decided
    chosen, record = _fit(decided, axes, (limits.budget_bytes, limits.source), limits.host_bytes,
                          limits.compute_flops)
    if heap_automatic and record.predicted_need_bytes > HEAP_SHARE * limits.budget_bytes:
        chosen = dataclasses.replace(chosen, train=dataclasses.replace(chosen.train, keep_freed_host_memory=False))
    return dataclasses.replace(chosen, fit=record)


@functools.lru_cache(maxsize=64)
def _fit(default: ResolvedConfig, axes: tuple[str, ...], budget: tuple[int, str], host_bytes: int,
         compute_flops: int) -> tuple[ResolvedConfig, FitRecord]:
    """`default` (every setting decided by its plain rule) or, when the memory model says it does not
    fit `budget` (bytes, source), the fastest layout over `axes` that does, its time at
    `compute_flops` per rank where measured (`mop.settle.budget.MemoryLimits`)."""
    world, node = default.world, default.local_world
    cluster = local_cluster("cpu" if _on_cpu(default) else "cuda", world, node, budget[0], host_bytes, compute_flops)
    plain = evaluate(default, cluster)
    if plain.fits:
        return default, _record(plain, budget, axes, True, 1, "today's layout fits")
    candidates = [evaluate(c, cluster) for c in _candidates(default, axes, world, node)]
    choice = choose(candidates)
    if choice.best is None:
        closest = choice.closest or plain
        raise ConfigError("train.memory_budget", f"nothing fits {budget[0] / GIB:.1f} GiB per rank ({budget[1]}) at "
                          f"data.seq_len={default.data.seq_len}: the closest layout ({describe(closest)}) needs "
                          f"{over(closest)}; raise train.memory_budget, lower data.seq_len, add ranks or leave "
                          f"more of {', '.join(_settings(a for a in AXES if a not in axes))} automatic")
    return choice.best.config, _record(choice.best, budget, axes, False, choice.considered, choice.binding)


def _candidates(default: ResolvedConfig, axes: tuple[str, ...], world: int, node: int):
    """Every combination of the automatic axes' values (the others as `default` has them), validated."""
    m, t = default.model, default.train
    values = {
        "sequence": [d for d in divisors(world) if m.heads % d == 0 and default.data.seq_len % d == 0],
        "expert": [e for e in divisors(node) if m.experts % e == 0],
        "vocab": [1] if m.tie_embeddings else divisors(node),
        "head_chunks": CHUNKS, "llep_chunks": CHUNKS, "checkpointing": ["none", "full"],
        "vocab_logits": ["keep", "recompute"],
        "offload": [False] if _on_cpu(default) else [False, True],
        "micro_batch": divisors(MOST_SEQUENCES_PER_MICRO_BATCH)}
    grid = [values[a] if a in axes else [None] for a in AXES]
    for combination in itertools.product(*grid):
        chosen = dict(zip(AXES, combination))
        settings = {a: v for a, v in chosen.items() if v is not None}
        if settings.get("offload") and (chosen["checkpointing"] or t.activation_checkpointing) == "none":
            continue
        config = _with(default, settings)
        if (config.parallel.sequence == 1 and config.parallel.attention_head_chunks > 1) or \
                (config.parallel.expert == 1 and config.parallel.llep_chunks > 1):
            continue  # the same run as one chunk
        try:
            check_resolved(config, launched=False)
        except (ConfigError, LayoutError):
            continue
        yield config


def _on_cpu(config: Config) -> bool:
    return visible_gpus(config.train.device) == 0


def _with(config: Config, settings: dict) -> Config:
    sections = {}
    for axis, value in settings.items():
        section, name = AXES[axis]
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(config, **{s: dataclasses.replace(getattr(config, s), **v) for s, v in sections.items()})


def _settings(axes) -> list[str]:
    return [".".join(AXES[a]) for a in axes]


def _record(c: Candidate, budget: tuple[int, str], axes, kept: bool, considered: int, binding: str) -> FitRecord:
    return FitRecord(budget[0], budget[1], tuple(_settings(axes)), describe(c), kept, c.memory.peak_device_bytes,
                     sum(c.memory.host_bytes_per_rank.values()), c.need_bytes, c.memory.peak.name.split(":")[0],
                     c.tokens_per_s_per_gpu, considered, binding)


def summary(record: FitRecord) -> str:
    """The start line's account of the fit."""
    share = f"{record.predicted_need_bytes / record.budget_bytes:.0%} of it"
    head = f"memory budget {record.budget_bytes / GIB:.1f} GiB per rank ({record.budget_source})"
    if record.kept_default:
        return f"{head}: the plain layout fits ({record.layout}; predicted {share})"
    searched = ", ".join(name.split(".")[1] for name in record.searched)
    return (f"{head}: fitted {searched} over {record.considered} layouts: {record.layout}; "
            f"predicted peak {record.predicted_peak_bytes / GIB:.2f} GiB at the {record.predicted_moment} + "
            f"{record.predicted_host_bytes / GIB:.2f} GiB host ({share}); {record.binding}")
