"""Rank layout: which ranks form each parallel sub-group, and the process groups over them.

Algorithm (DESIGN.md section 1). The world of W ranks is cut three independent ways, one per
parallelism degree n in {D = parallel.sequence, Ep = parallel.expert, P = parallel.vocab}:

- a *block* group is a run of n consecutive ranks ``[b*n, (b+1)*n)``, so a small degree stays
  inside a node. Sequence (Ulysses), expert (LLEP) and vocabulary (ring loss) groups are blocks.
- a *replica* group is the W/n ranks holding the same position ``i`` in their blocks,
  ``[i, i+n, i+2n, ...]``. The expert partition ``i`` is FSDP-sharded over its expert-replica
  group; vocabulary gradients are all-reduced over the vocab-replica group.

For rank r: block index ``r // n``, position in the block ``r % n``; r is member ``r % n`` of
its block group and member ``r // n`` of its replica group. D, Ep and P need not divide each
other: the three cuts are not axes of one Cartesian product, only each divides W.

Invariants: every family of groups partitions ``range(W)``, each rank in exactly one group of
each family, and the members of every group are listed in ascending rank order (which is the
order torch's group-local ranks use).

``Layout`` is that arithmetic alone (no processes; usable in the planner and in tests).
``DistLayout`` is the same layout materialised on one running rank: torch DeviceMeshes of shape
``(W//n, n)`` over ``arange(W).reshape(W//n, n)`` whose dim 0 is the replica group and dim 1 the
block group (checked on construction), the 1-D world mesh for the dense FSDP2 units, and a second
communicator over the expert group for LLEP's weight point-to-point traffic. It is passed
explicitly to every technique; nothing here is global.

Process setup: ``backend_for`` maps a device to its backend (gloo on CPU, NCCL on CUDA; the only
CPU/GPU difference), ``init_distributed`` joins the job torchrun launched (env:// rendezvous),
``set_rank_threads`` splits the host's cores between the local ranks (DESIGN.md section 5).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Subgroups (new_group, DeviceMesh) get the backend's default timeout, not the default group's;
# this sets it on the groups DeviceMesh has already created. torch 2.14 made the setter public
# (dist.set_timeout) and deprecated the private one, whose warning would be a second error line.
from torch.distributed.distributed_c10d import _set_pg_timeout

set_group_timeout = getattr(dist, "set_timeout", _set_pg_timeout)


class LayoutError(ValueError):
    """An impossible (W, D, Ep, P); the message names the setting and the fix."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _block_of(n: int, rank: int) -> list[int]:
    start = rank - rank % n
    return list(range(start, start + n))


def _replica_of(world: int, n: int, rank: int) -> list[int]:
    return list(range(rank % n, world, n))


@dataclass(frozen=True)
class Layout:
    """World size and the three parallel degrees, validated; pure rank arithmetic."""

    world: int
    sequence: int = 1
    expert: int = 1
    vocab: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.world) or self.world < 1:
            raise LayoutError(f"world size {self.world!r} must be an integer >= 1; launch at least one rank")
        choices = ", ".join(map(str, _divisors(self.world)))
        for name in ("sequence", "expert", "vocab"):
            n = getattr(self, name)
            if not _is_int(n) or n < 1:
                raise LayoutError(
                    f"parallel.{name}={n!r} must be an integer >= 1; "
                    f"choose a divisor of {self.world}: {choices}"
                )
            if self.world % n:
                raise LayoutError(
                    f"parallel.{name}={n} does not divide the world size {self.world}; "
                    f"choose a divisor of {self.world}: {choices}"
                )

    # Groups are blocks of n consecutive ranks (sequence, expert, vocabulary) and the strided
    # replicas across them (expert replicas, vocabulary replicas); `DistLayout` builds them.

    def expert_groups(self) -> list[list[int]]:
        """LLEP groups: blocks of Ep ranks that exchange tokens and expert weights."""
        return [list(range(start, start + self.expert)) for start in range(0, self.world, self.expert)]

    @property
    def vocab_replicas(self) -> int:
        """Ranks holding the same vocabulary shard: W // P."""
        return self.world // self.vocab

    def expert_partition(self, rank: int) -> int:
        """Which expert partition the rank owns (a shard of it): its position in its expert group."""
        return self._check(rank) % self.expert

    def vocab_shard(self, rank: int) -> int:
        """Which block of V/P vocabulary rows the rank holds: its position in its vocabulary group."""
        return self._check(rank) % self.vocab

    def _check(self, rank: int) -> int:
        if not _is_int(rank) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is outside the world of {self.world} ranks")
        return rank


def _is_int(x: object) -> bool:
    # bool is an int subclass; parallel.expert=True is a config typo, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


class DistLayout:
    """A ``Layout`` materialised on this rank: its DeviceMeshes and process groups.

    Collective: every rank of the default group must construct it, with the same layout, at the
    same point in the program, because creating a group is itself a collective over all ranks.
    """

    def __init__(self, layout: Layout, device: torch.device, timeout: timedelta | None = None) -> None:
        """`timeout`: how long any collective of the layout's groups may wait (`parallel.timeout_s`);
        None keeps torch's defaults (10 minutes for NCCL, 30 for gloo)."""
        if not dist.is_initialized():
            raise RuntimeError("DistLayout needs an initialised default process group; call init_distributed first")
        if dist.get_world_size() != layout.world:
            raise LayoutError(
                f"the layout is for {layout.world} ranks but {dist.get_world_size()} were launched; "
                f"launch {layout.world} ranks or build the Layout from the launched world size"
            )
        self.layout = layout
        self.device = device
        self.rank = dist.get_rank()
        w = layout.world
        self.world_mesh: DeviceMesh = init_device_mesh(device.type, (w,), mesh_dim_names=("world",))
        self.sequence_mesh = self._mesh(layout.sequence, ("data", "sequence"))
        self.expert_mesh = self._mesh(layout.expert, ("expert_replica", "expert"))
        self.vocab_mesh = self._mesh(layout.vocab, ("vocab_replica", "vocab"))
        # A second communicator over each expert group: weights shipped to LLEP helpers travel on
        # it so they can overlap the token all-to-all instead of queueing behind it on one stream.
        # new_group is collective over the world, so every rank creates every block's group.
        self.expert_p2p_group: dist.ProcessGroup
        for ranks in layout.expert_groups():
            group = dist.new_group(ranks=ranks, group_desc="llep_weights")
            if self.rank in ranks:
                self.expert_p2p_group = group
        if timeout is not None:
            for group in self._groups():
                set_group_timeout(timeout, group)
        self._warm_up()

    def _warm_up(self) -> None:
        """One all-reduce on every group this rank belongs to, family by family in the same order on
        every rank. NCCL creates a group's communicator at its first collective, and the first use
        of the LLEP point-to-point group would otherwise be a send between two of its ranks only,
        which NCCL leaves undefined; it also moves every communicator's set-up cost to start-up."""
        token = torch.zeros(1, device=self.device)
        for group in self._groups():
            dist.all_reduce(token, group=group)

    def _groups(self) -> list[dist.ProcessGroup]:
        """Every group this rank belongs to, in the same order on every rank."""
        meshes = [(self.world_mesh, ("world",)), (self.sequence_mesh, ("data", "sequence")),
                  (self.expert_mesh, ("expert_replica", "expert")), (self.vocab_mesh, ("vocab_replica", "vocab"))]
        return [mesh.get_group(name) for mesh, names in meshes for name in names] + [self.expert_p2p_group]

    def _mesh(self, n: int, names: tuple[str, str]) -> DeviceMesh:
        w, r = self.layout.world, self.rank
        mesh = init_device_mesh(self.device.type, (w // n, n), mesh_dim_names=names)
        # The layout's meaning rests on torch's row-major mesh convention (dim 0 = strided
        # replicas, dim 1 = consecutive blocks); verify it rather than trust it, since every
        # technique inherits it.
        _expect(mesh, names[0], _replica_of(w, n, r))
        _expect(mesh, names[1], _block_of(n, r))
        return mesh

    @property
    def world_group(self) -> dist.ProcessGroup:
        return self.world_mesh.get_group("world")

    @property
    def sequence_group(self) -> dist.ProcessGroup:
        return self.sequence_mesh.get_group("sequence")

    @property
    def expert_group(self) -> dist.ProcessGroup:
        return self.expert_mesh.get_group("expert")

    @property
    def expert_replica_group(self) -> dist.ProcessGroup:
        return self.expert_mesh.get_group("expert_replica")

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """1-D mesh over this rank's expert-replica group: FSDP2 shards a partition over it."""
        return self.expert_mesh["expert_replica"]

    @property
    def vocab_group(self) -> dist.ProcessGroup:
        return self.vocab_mesh.get_group("vocab")

    @property
    def vocab_replica_group(self) -> dist.ProcessGroup:
        return self.vocab_mesh.get_group("vocab_replica")


def _expect(mesh: DeviceMesh, dim: str, ranks: list[int]) -> None:
    got = dist.get_process_group_ranks(mesh.get_group(dim))
    if got != ranks:
        raise RuntimeError(f"DeviceMesh dim {dim!r} spans ranks {got}, the layout expects {ranks}")


# Process setup.


class TorchrunEnv(NamedTuple):
    """This process's place in a torchrun (torch elastic) launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> TorchrunEnv:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        missing = [k for k in keys if k not in environ]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: launch distributed runs with torchrun")
        return cls(*(int(environ[k]) for k in keys))


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device``: gloo on CPU, NCCL on CUDA."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise ValueError(f"no collective backend for device type {device.type!r}; use cpu or cuda")


def device_for(local_rank: int) -> torch.device:
    """One GPU per local rank when there are GPUs, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(device: torch.device, timeout: timedelta | None = None) -> None:
    """Join the job via env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them);
    `timeout` bounds every collective of the default group (None: torch's default)."""
    if device.type == "cuda":
        # Bind before init so NCCL's communicators and the barrier use this rank's GPU.
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend_for(device),
        init_method="env://",
        device_id=device if device.type == "cuda" else None,
        timeout=timeout,
    )


def rank_threads(local_world_size: int) -> int:
    """One local rank's equal share of the host's cores."""
    return max(1, (os.cpu_count() or 1) // local_world_size)


def set_rank_threads(local_world_size: int) -> int:
    """Give each local rank an equal share of the host's cores; returns the thread count."""
    threads = rank_threads(local_world_size)
    torch.set_num_threads(threads)
    return threads
