"""Where a training process sits: joining the ranks torchrun (or `mop.launch`) started, its device and layout.

A process started by torchrun (or torch's elastic launcher) finds RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE in its environment, joins the others (gloo on CPU, NCCL on CUDA: the backend
follows the device), and builds the layout (`DistLayout`) from the configured degrees, resolved
for the world size. Without them it is the single process of the reference strategy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
from datetime import timedelta

import torch
import torch.distributed as dist

from mop.config import Config, ConfigError
from mop.parallel.mesh import DistLayout, Layout, TorchrunEnv, device_for, init_distributed, set_rank_threads

if TYPE_CHECKING:
    from mop.resolve import ResolvedConfig


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


def pick_device(config: Config, local_rank: int) -> torch.device:
    if config.train.device == "cpu":
        return torch.device("cpu")
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "'cuda' was asked for but no GPU is visible; use --train.device=cpu or auto")
    return device_for(local_rank)


def setup_runtime(config: Config) -> tuple[ResolvedConfig, Runtime]:
    """Join the ranks (under torchrun) and build the layout; returns the config resolved for this
    world (`mop.resolve`: a config resolved for it already, as mop's launcher passes its ranks,
    is used as it is) and where this process sits."""
    from mop.resolve import ResolvedConfig, check_ranks_fit_gpus, resolve  # it imports the parts that import this

    if not under_torchrun():
        config = config if isinstance(config, ResolvedConfig) and config.world == 1 else resolve(config, world=1)
        return config, Runtime(0, 1, pick_device(config, 0), None)
    env = TorchrunEnv.from_environ()
    check_ranks_fit_gpus(env.local_world_size, config.train.device, "torchrun --nproc_per_node")
    device = pick_device(config, env.local_rank)
    if device.type == "cpu":
        set_rank_threads(env.local_world_size)
    timeout = timedelta(seconds=config.parallel.timeout_s)
    init_distributed(device, timeout)
    if not (isinstance(config, ResolvedConfig) and config.world == env.world_size):
        config = resolve(config, world=env.world_size, local_world=smallest_node(env.local_world_size, device))
    p = config.parallel
    layout = DistLayout(Layout(env.world_size, p.sequence, p.expert, p.vocab), device, timeout)
    return config, Runtime(env.rank, env.world_size, device, layout)


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
