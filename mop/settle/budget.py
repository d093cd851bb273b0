"""The memory one rank may use, and its speed: `train.memory_budget` parsed once (`MemoryBudget`),
then measured on this machine (`MemoryLimits`).

`MemoryBudget.read(train)` parses the setting once (a size such as "70GiB", "9.5GB" or "12e9"
bytes, "auto" or "off"; anything else is one `ConfigError` naming the setting), before anything
else is decided; `limits(local_ranks)` then asks the machine once, giving `MemoryLimits`:
- a size is the budget as written;
- "auto" is, on CUDA, the smallest visible GPU's memory, on the CPU the host's (the smaller of
  physical memory and a cgroup limit) over the node's ranks, each x `BUDGET_SHARE` less
  `BUDGET_RESERVE`: the same on every rank of a node and on every relaunch;
- "off" is no budget (the fit keeps the plain rules).
The host memory of the rank's node rides along: on the CPU host and device are one memory, so
the fit counts a rank's host bytes against the budget too. So does, on a CPU with a budget to fit,
the FLOP/s a rank's matrix multiplies reach (`mop.flops.matmul_probe` in the run's compute dtype,
with the rank's share of the cores): the fit's roofline computes at that rate instead of a nominal
one (`mop.cost.cluster.local_cluster`).

Under torchrun every rank must fit its layout to the same limits: `smallest_over_ranks` takes the
smallest budget, host memory and probe of any rank (one all-reduce over the world).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mop.config import ConfigError, TrainConfig
from mop.cost.cluster import GIB
from mop.flops import matmul_probe
from mop.parallel.mesh import rank_threads
from mop.runtime import visible_gpus

_SIZE_UNITS = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3,
               "b": 1}
BUDGET_SHARE, BUDGET_RESERVE = 0.95, GIB  # of the device's (the host's) memory; the rest: context, libraries, slack


@dataclass(frozen=True)
class MemoryLimits:
    """What one rank may use (module docstring)."""

    budget_bytes: int | None
    """The rank's budget; None for `train.memory_budget = "off"`."""
    source: str
    """How the budget was found, for the start line ("train.memory_budget=70GiB", "auto: ...")."""
    host_bytes: int
    """The host memory of the rank's node."""
    compute_flops: int = 0
    """On a CPU with a budget: the FLOP/s one rank's matrix multiplies reach (the probe); 0: not
    measured (a GPU, whose roofline is its preset's, or no budget to fit)."""

    def smallest_over_ranks(self, device: torch.device) -> MemoryLimits:
        """The smallest budget, host memory and probe of any rank (one all-reduce; the budget is
        "off" on every rank alike, and so is the probe's absence)."""
        value = torch.tensor([self.budget_bytes or 0, self.host_bytes, self.compute_flops], dtype=torch.int64,
                             device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        budget = None if self.budget_bytes is None else int(value[0])
        return replace(self, budget_bytes=budget, source=f"{self.source}; the smallest of every rank's",
                       host_bytes=int(value[1]), compute_flops=int(value[2]))


@dataclass(frozen=True)
class MemoryBudget:
    """`train.memory_budget` parsed (module docstring), before the machine is asked."""

    setting: str
    size: int | str | None
    """Bytes, "auto" or None ("off")."""
    device: str
    """`train.device`, which says whose memory "auto" shares."""
    compute_dtype: torch.dtype = torch.float32
    """The dtype the run's matrix multiplies run in (what the CPU's probe measures)."""

    @classmethod
    def read(cls, train: TrainConfig) -> MemoryBudget:
        """The setting parsed; a bad value raises ConfigError."""
        return cls(train.memory_budget, parse_budget(train.memory_budget), train.device, train.compute_dtype)

    def limits(self, local_ranks: int) -> MemoryLimits:
        """The limits on this machine, for a node of `local_ranks` ranks."""
        host = host_memory_bytes()
        if self.size is None:
            return MemoryLimits(None, "train.memory_budget=off", host)
        compute = 0 if visible_gpus(self.device) else cpu_rank_probe(local_ranks, self.compute_dtype)
        if self.size != "auto":
            return MemoryLimits(self.size, f"train.memory_budget={self.setting}", host, compute)
        if visible_gpus(self.device):
            total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
            where = f"{total / GIB:.1f} GiB GPU memory"
        else:
            total = host // max(local_ranks, 1)
            where = f"{host / GIB:.1f} GiB host memory / {local_ranks} ranks"
        source = f"auto: {where} x {BUDGET_SHARE:g} less {BUDGET_RESERVE / GIB:g} GiB"
        return MemoryLimits(int(total * BUDGET_SHARE - BUDGET_RESERVE), source, host, compute)


def cpu_rank_probe(local_ranks: int, dtype: torch.dtype) -> int:
    """FLOP/s of `mop.flops.matmul_probe` on the CPU with one rank's share of the cores (as
    `mop.parallel.mesh.set_rank_threads` gives a rank; a rank itself already runs with it): what
    each of `local_ranks` ranks' GEMMs reach. Cached per process and thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(local_ranks))
    try:
        return int(matmul_probe(torch.device("cpu"), dtype))
    finally:
        torch.set_num_threads(threads)


def parse_budget(setting: str) -> int | str | None:
    """`train.memory_budget` read without asking the machine: bytes, "auto" or None ("off"); a bad
    value raises ConfigError."""
    text = setting.strip().lower()
    if text in ("off", "auto"):
        return None if text == "off" else "auto"
    unit = next((u for u in _SIZE_UNITS if text.endswith(u)), "")
    try:
        value = float(text.removesuffix(unit)) * _SIZE_UNITS.get(unit, 1)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError("train.memory_budget", f"{setting!r} is not a size; use e.g. '70GiB', '9.5GB', '12e9' "
                          "(bytes), 'auto' or 'off'")
    return int(value)


def host_memory_bytes() -> int:
    """Physical memory, or the process's cgroup limit when that is smaller (a container's share)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
