"""Where a training process sits: joining the ranks torchrun (or `mop.launch`) started, its device and layout.

A process started by torchrun (or torch's elastic launcher) finds RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE in its environment and joins the others (`join`: gloo on CPU, NCCL on CUDA, the
backend follows the device); once its caller has resolved the settings for that world
(`mop.train.setup_runtime`), it builds the layout (`DistLayout`) of their degrees (`joined`).
Without them it is the single process of the reference strategy. Also the reductions over all
ranks that the loop and the evaluation share.
"""

from __future__ import annotations

import ctypes
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

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


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


def keep_freed_host_memory() -> bool:
    """glibc's allocator keeps what this process frees for reuse: large blocks come from the heap
    rather than from their own mmap (unmapped on free), and the heap's top is never trimmed. False
    where the C library has no mallopt (not glibc)."""
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    largest = 2**31 - 1  # both settings are C ints
    return bool(mallopt(M_MMAP_THRESHOLD, largest // 64 * 64) and mallopt(M_TRIM_THRESHOLD, largest))


def set_host_heap(config) -> None:
    """This process's heap as the resolved `config` decided it (`train.keep_freed_host_memory`)."""
    if config.train.keep_freed_host_memory:
        keep_freed_host_memory()


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
    """Where this rank sits once `config` is resolved for the world: its layout of the degrees, and
    its host heap as `train.keep_freed_host_memory` was decided (before the model is built)."""
    set_host_heap(config)
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
