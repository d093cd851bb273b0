"""Where a training process sits: joining the ranks torchrun (or `mop.launch`) started, its device and layout.

A process started by torchrun (or torch's elastic launcher) finds RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE in its environment and joins the others (`join`: gloo on CPU, NCCL on CUDA, the
backend follows the device); once its caller has resolved the settings for that world
(`mop.train.setup_runtime`), it builds the layout (`DistLayout`) of their degrees (`joined`).
Without them it is the single process of the reference strategy. Also the reductions over all
ranks that the loop and the evaluation share, and the memory a rank may use (`memory_budget`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mop.config import Config, ConfigError
from mop.parallel.mesh import (
    DistLayout,
    Layout,
    TorchrunEnv,
    device_for,
    init_distributed,
    set_rank_threads,
)


@dataclass
class Runtime:
    """Where this process sits: its rank, device and (for distributed runs) its layout."""

    rank: int
    world: int
    device: torch.device
    layout: DistLayout | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world_group(self):
        """The process group of every rank (None: one process)."""
        return self.layout.world_group if self.layout is not None else None


def under_torchrun() -> bool:
    """True when this process was started by torchrun / torch elastic (it sets these variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def visible_gpus(device: str) -> int:
    """The GPUs a local launch gives one rank each under `train.device = device`: 0 on the CPU."""
    if device == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


GIB = 2**30
_SIZE_UNITS = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3,
               "b": 1}
BUDGET_SHARE, BUDGET_RESERVE = 0.95, GIB  # of the device's (the host's) memory; the rest: context, libraries, slack


def memory_budget(setting: str, device: str, local_ranks: int) -> tuple[int, str] | None:
    """The bytes one rank may use under `train.memory_budget = setting` and how they were found;
    None for "off". "auto": on CUDA the smallest visible GPU's memory, on the CPU the host's (the
    smaller of physical memory and a cgroup limit) over the node's ranks, each x `BUDGET_SHARE`
    less `BUDGET_RESERVE`: the same on every rank of a node and on every relaunch."""
    size = check_memory_budget(setting)
    if size is None:
        return None
    if size != "auto":
        return size, f"train.memory_budget={setting}"
    if visible_gpus(device):
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where = f"{total / GIB:.1f} GiB GPU memory"
    else:
        host = host_memory_bytes()
        total = host // max(local_ranks, 1)
        where = f"{host / GIB:.1f} GiB host memory / {local_ranks} ranks"
    return int(total * BUDGET_SHARE - BUDGET_RESERVE), f"auto: {where} x {BUDGET_SHARE:g} less 1 GiB"


def check_memory_budget(setting: str) -> int | str | None:
    """`train.memory_budget` read without asking the device: bytes, "auto" or None ("off"); a bad
    value raises ConfigError."""
    text = setting.strip().lower()
    return None if text == "off" else "auto" if text == "auto" else _parse_size(setting)


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


def _parse_size(text: str) -> int:
    number = text.strip().lower()
    unit = next((u for u in _SIZE_UNITS if number.endswith(u)), "")
    try:
        value = float(number.removesuffix(unit)) * _SIZE_UNITS.get(unit, 1)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError("train.memory_budget", f"{text!r} is not a size; use e.g. '70GiB', '9.5GB', '12e9' (bytes), "
                          "'auto' or 'off'")
    return int(value)


def smallest_limits(budget: int | None, host: int, device: torch.device) -> tuple[int | None, int]:
    """The smallest memory budget and host memory of any rank (one all-reduce): every rank must fit
    its layout to the same ones. `budget` is None ("off") on every rank alike."""
    value = torch.tensor([budget or 0, host], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return (None if budget is None else int(value[0])), int(value[1])


def check_ranks_fit_gpus(ranks: int, device: str, setting: str) -> None:
    """Each local rank needs its own GPU; `setting` is the one that sets `ranks` (mop's launcher:
    --parallel.nproc; torchrun: --nproc_per_node)."""
    gpus = visible_gpus(device)
    if gpus and ranks > gpus:
        raise ConfigError("parallel.nproc", f"{ranks} ranks on this node but {gpus} visible GPU(s), and each rank "
                          f"needs its own GPU; start at most {gpus} ({setting}={gpus}), or use --train.device=cpu")


def pick_device(config: Config, local_rank: int) -> torch.device:
    if config.train.device == "cpu":
        return torch.device("cpu")
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "'cuda' was asked for but no GPU is visible; use --train.device=cpu or auto")
    return device_for(local_rank)


def join(config, env: TorchrunEnv) -> torch.device:
    """Join the ranks torchrun started (`env`): this rank's device, its threads on a CPU, the
    process group (the backend follows the device)."""
    check_ranks_fit_gpus(env.local_world_size, config.train.device, "torchrun --nproc_per_node")
    device = pick_device(config, env.local_rank)
    if device.type == "cpu":
        set_rank_threads(env.local_world_size)
    init_distributed(device, timedelta(seconds=config.parallel.timeout_s))
    return device


def joined(config, env: TorchrunEnv, device: torch.device) -> Runtime:
    """Where this rank sits once `config` is resolved for the world: its layout of the degrees."""
    p = config.parallel
    layout = DistLayout(Layout(env.world_size, p.sequence, p.expert, p.vocab), device, timedelta(seconds=p.timeout_s))
    return Runtime(env.rank, env.world_size, device, layout)


def smallest_node(local_world: int, device: torch.device) -> int:
    """The fewest ranks any node runs: every rank must resolve the same automatic degrees, and
    nodes may run different numbers of ranks."""
    ranks = torch.tensor([local_world], device=device)
    dist.all_reduce(ranks, op=dist.ReduceOp.MIN)
    return int(ranks.item())


def sum_over_ranks(values: list[float], runtime: Runtime, op=dist.ReduceOp.SUM) -> list[float]:
    """`values` reduced (summed, or `op`) over all ranks (one all-reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.layout is not None:
        dist.all_reduce(tensor, op=op, group=runtime.layout.world_group)
    return tensor.tolist()


def sum_tensor_over_ranks(tensor: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """`tensor` summed over all ranks on its device (no host read), in place."""
    if runtime.layout is not None:
        dist.all_reduce(tensor, group=runtime.layout.world_group)
    return tensor


def per_rank(values: list[float], runtime: Runtime) -> list[list[float]]:
    """`values` of every rank, in rank order (one all-gather)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.layout is None:
        return [tensor.tolist()]
    gathered = [torch.empty_like(tensor) for _ in range(runtime.world)]
    dist.all_gather(gathered, tensor, group=runtime.layout.world_group)
    return torch.stack(gathered).tolist()
