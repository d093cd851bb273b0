"""Global views: how each rank's local parameter tensors appear as parts of the unwrapped model's tensors.

Every parameter of a parallelised model is a block of rows (dim 0) of one global tensor, named
by the parameter's name in the unwrapped model (`canonical_name`), placed as the run's placement
record says (`mop.parallel.placement`):
- an FSDP2-sharded weight is a DTensor over the world (`Shard(0)`);
- an expert partition (FSDP2 over the expert-replica group) is presented on a 2-D mesh
  `[expert, expert_replica]` (the expert mesh transposed, built without process groups) as
  `[Shard(0), Shard(0)]`: the partition's block of experts, then the replica's slice of it;
- the vocabulary shard is presented on the vocabulary mesh as `[Replicate(), Shard(0)]` of the
  unpadded `[V, H]` weight: its padding rows are cut off, and torch's chunking of V rows over P
  shards is exactly the `ceil(V/P)` rows per shard the vocabulary head uses;
- a plain tensor (the reference strategy) is the whole global tensor.

Users: `mop.checkpoint` presents every local tensor (parameters, and host-optimizer state
shaped like them) as a DTensor of the global shape, so DCP reshards between layouts;
`mop.parallel.materialize` asks which global rows a local tensor holds, to initialise it alone.

Host tensors (the host optimizer's fp32 masters and moments) get the same placements on a CPU
twin of each mesh (same ranks, no process groups): a DTensor on a CUDA mesh would make DCP copy
them to the GPU to save them, and load into those copies instead of the host tensors.
No view communicates; building one is metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mop.parallel.checkpointing import canonical_name
from mop.parallel.mesh import DistLayout
from mop.parallel.placement import placements


@dataclass(frozen=True)
class _Placement:
    """A local tensor's place in its global tensor; `mesh` None: the local tensor is the global one."""

    mesh: DeviceMesh | None
    placements: tuple
    shape: torch.Size
    rows: int | None = None  # local rows that are real (the vocabulary shard's padding is cut off)


class GlobalViews:
    """For each parameter of a (parallelised) model: how its local tensors appear as global ones."""

    def __init__(self, model: torch.nn.Module, layout: DistLayout | None):
        self.names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
        self._place: dict[int, _Placement] = {}
        self._cpu_meshes: dict[int, DeviceMesh] = {}
        shape = layout.layout if layout is not None else None
        record = placements(model.cfg, shape.world, shape.expert, shape.vocab, model.lora) if shape is not None else {}
        expert_mesh = None
        for param in model.parameters():
            place = record.get(self.names[id(param)])
            if shape is not None and place is None:
                raise RuntimeError(f"{self.names[id(param)]} has no placement; mop.parallel.placement must list it")
            if place is not None and place.fsdp_group == "expert_replica":
                if expert_mesh is None:  # metadata only: no process groups are created
                    expert_mesh = _mesh_without_groups(layout.device.type, layout.expert_mesh.mesh.t(),
                                                       ("expert", "expert_replica"))
                view = _Placement(expert_mesh, (Shard(0), Shard(0)), torch.Size(place.shape))
            elif place is not None and not place.fsdp_group and place.partitions > 1:  # the ring's row shard
                view = _Placement(layout.vocab_mesh, (Replicate(), Shard(0)), torch.Size(place.shape),
                                  rows=place.real_rows(shape.vocab_shard(layout.rank)))
            elif isinstance(param, DTensor):
                view = _Placement(param.device_mesh, tuple(param.placements), param.shape)
            else:
                view = _Placement(None, (), param.shape)
            self._place[id(param)] = view

    def global_shape(self, param: torch.Tensor) -> torch.Size:
        return self._place[id(param)].shape

    def local(self, param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
        """The part of `local` (default: the parameter's local tensor) that belongs to the global
        tensor: all of it, except the vocabulary shard's padding rows."""
        if local is None:
            local = param.to_local() if isinstance(param, DTensor) else param
        elif isinstance(local, DTensor):
            local = local.to_local()
        rows = self._place[id(param)].rows
        return local if rows is None else local[:rows]

    def first_row(self, param: torch.Tensor) -> int:
        """The global row (dim 0 index) of this rank's first local row of `param`."""
        place = self._place[id(param)]
        if place.mesh is None:
            return 0
        _, offset = compute_local_shape_and_global_offset(place.shape, place.mesh, place.placements)
        if any(offset[1:]):
            raise NotImplementedError(f"{self.names[id(param)]}: only row (dim 0) sharding is supported")
        return offset[0]

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this rank's local rows of `param` are the copy a gather takes: its coordinate is 0
        on every mesh dimension that replicates them (each global row then has exactly one owner)."""
        place = self._place[id(param)]
        if place.mesh is None:
            return True
        coordinate = place.mesh.get_coordinate()
        return all(c == 0 for c, p in zip(coordinate, place.placements) if isinstance(p, Replicate))

    def of(self, param: torch.Tensor, local: torch.Tensor | None = None, host: bool = False) -> torch.Tensor:
        """The global view of `local` (a tensor shaped like `param`'s local shard; default: the
        param's); `host`: `local` lives in host memory (see the module docstring)."""
        place = self._place[id(param)]
        local = self.local(param, local).detach()
        if place.mesh is None:
            return local
        mesh = self._cpu_mesh(place.mesh) if host else place.mesh
        stride = torch.empty(place.shape, device="meta").stride()
        return DTensor.from_local(local, mesh, place.placements, run_check=False, shape=place.shape, stride=stride)

    def _cpu_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if mesh.device_type == "cpu":
            return mesh
        if id(mesh) not in self._cpu_meshes:
            self._cpu_meshes[id(mesh)] = _mesh_without_groups("cpu", mesh.mesh, mesh.mesh_dim_names)
        return self._cpu_meshes[id(mesh)]


def _mesh_without_groups(device_type: str, ranks: torch.Tensor, names) -> DeviceMesh:
    return DeviceMesh(device_type, ranks.contiguous(), mesh_dim_names=names, _init_backend=False)
