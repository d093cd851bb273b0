"""Scoring layouts: a config's predicted memory and step time on a cluster (`Candidate`), and the
choice among them (`choose`): the fastest that fits; among those within `SPEED_RESOLUTION` of it
(closer than a roofline can tell apart), the one needing the least memory. Shared by `mop plan`'s
search (`mop.plan.search`) and `mop train`'s fit to its memory budget (`mop.settle.fit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mop.config import Config
from mop.cost.cluster import GIB, Cluster
from mop.cost.memory import MemoryEstimate, estimate
from mop.cost.speed import StepTime, step_time

SPEED_RESOLUTION = 0.02


def divisors(n: int) -> list[int]:
    """1..n's divisors of n: the degrees (and micro-batches) a layout may take."""
    return [d for d in range(1, n + 1) if n % d == 0]
# (optim.offload, optim.speculative): the host optimizer with and without rollback copies, torch AdamW.
OPTIMIZERS = {"host-optimizer": (True, True), "host-optimizer (no rollback copies)": (True, False),
              "device-adamw": (False, True)}

@dataclass
class Candidate:
    """One configuration with its predicted memory and speed."""

    config: Config
    tp: int
    memory: MemoryEstimate
    time: StepTime
    cluster: Cluster

    @property
    def need_bytes(self) -> int:
        """What counts against a rank's device budget: its device peak (and its host bytes where
        host and device are one memory)."""
        host = sum(self.memory.host_bytes_per_rank.values()) if self.cluster.unified_memory else 0
        return self.memory.peak_device_bytes + host

    @property
    def fits_device(self) -> bool:
        return self.need_bytes <= self.cluster.budget_bytes

    @property
    def fits_host(self) -> bool:
        return self.memory.host_bytes_per_node <= self.cluster.host_bytes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.time.tokens / self.time.seconds

    def settings(self) -> tuple:
        p, t = self.config.parallel, self.config.train
        o = self.config.optim
        return (p.sequence, p.expert, p.vocab, p.attention_head_chunks, p.llep_chunks, self.tp, p.fsdp_cpu_offload,
                t.activation_checkpointing, t.offload_activations, (o.offload, o.speculative), t.micro_batch,
                p.vocab_logits)


def evaluate(config: Config, cluster: Cluster, tp: int = 1, routing_skew: float = 1.0,
             document_tokens: int = 0) -> Candidate:
    memory = estimate(config, cluster.world, cluster.gpus_per_node, routing_skew, tp)
    time = step_time(config, cluster, memory.shapes, memory.counts, tp, document_tokens, memory.adapters)
    return Candidate(config, tp, memory, time, cluster)


@dataclass
class Choice:
    """The best candidate of one system (None when nothing fits) and why it is the best."""

    best: Candidate | None
    closest: Candidate | None  # the best, or when nothing fits the candidate nearest to fitting
    binding: str
    considered: int


def choose(candidates: list[Candidate]) -> Choice:
    """The fastest candidate that fits; among those within `SPEED_RESOLUTION` of it (closer than a
    roofline can tell apart), the one with the smallest device peak."""
    fitting = [c for c in candidates if c.fits]
    fastest = max((c.tokens_per_s_per_gpu for c in fitting), default=0.0)
    near = [c for c in fitting if c.tokens_per_s_per_gpu >= (1 - SPEED_RESOLUTION) * fastest]
    best = min(near, key=lambda c: (c.memory.peak_device_bytes, -c.tokens_per_s_per_gpu), default=None)
    closest = best or min(candidates, key=_overrun, default=None)
    return Choice(best, closest, binding(best, closest, candidates), len(candidates))


def binding(best: Candidate | None, closest: Candidate | None, candidates: list[Candidate]) -> str:
    """Why nothing faster was chosen: the fastest rejected layout and the limit it broke (when nothing
    fits, what the `closest` layout needs)."""
    faster = [c for c in candidates if not c.fits and (best is None or
                                                       c.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu)]
    if best is None:
        return "no candidate" if closest is None else f"nothing fits: the closest layout ({describe(closest)}) needs " \
            f"{over(closest)}"
    if not faster:
        share = best.memory.peak_device_bytes / best.cluster.budget_bytes
        return f"compute and communication: the fastest layout fits, at {share:.0%} of the device budget"
    # the most telling rival: the fastest one that differs from the choice in one setting
    mine = best.settings()
    near = [c for c in faster if sum(a != b for a, b in zip(c.settings(), mine)) == 1]
    rival = max(near or faster, key=lambda c: c.tokens_per_s_per_gpu)
    return (f"memory: {describe(rival)} would run at {rival.tokens_per_s_per_gpu:.0f} tokens/s/GPU but needs "
            f"{over(rival)}")


def _overrun(c: Candidate) -> float:
    """How far a candidate is from fitting: its worse ratio of need to budget, device or host."""
    return max(c.need_bytes / c.cluster.budget_bytes, c.memory.host_bytes_per_node / c.cluster.host_bytes)


def over(c: Candidate) -> str:
    if not c.fits_device:
        peak = c.memory.peak
        row = max(peak.rows, key=peak.rows.get)
        host = (f" + {(c.need_bytes - peak.total) / GIB:.1f} GiB host memory in the same memory"
                if c.cluster.unified_memory else "")
        return (f"{peak.total / GIB:.1f} GiB of device memory{host} > {c.cluster.budget_bytes / GIB:.1f} GiB budget "
                f"(at the {peak.name.split(':')[0]}; largest row {row} {peak.rows[row] / GIB:.1f} GiB)")
    return (f"{c.memory.host_bytes_per_node / GIB:.0f} GiB of host memory per node > "
            f"{c.cluster.host_bytes / GIB:.0f} GiB")


def describe(c: Candidate) -> str:
    """The layout in a few words: degrees and options."""
    p, t = c.config.parallel, c.config.train
    memory = "ac+offload" if t.offload_activations else ("ac" if t.activation_checkpointing == "full" else "no ac")
    if p.strategy == "fsdp2":
        fsdp = c.cluster.world // (p.sequence * c.tp)
        return (f"FSDP {fsdp} EP {p.expert} CP {p.sequence} TP {c.tp} {memory}"
                f"{' cpu-offload' if p.fsdp_cpu_offload else ''}")
    optimizer = next(k for k, v in OPTIMIZERS.items() if v == (c.config.optim.offload, c.config.optim.speculative))
    logits = " logits-recomputed" if p.vocab_logits == "recompute" else ""
    return (f"D {p.sequence} Ep {p.expert} P {p.vocab}{logits} heads/{p.attention_head_chunks} llep/{p.llep_chunks} "
            f"{memory} {optimizer} mb {t.micro_batch}")
