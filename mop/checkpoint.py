"""Training checkpoints: layout-independent, atomic, the newest K kept; `torch.distributed.checkpoint`.

Content of one checkpoint (a directory `step_<N>`, N = optimizer steps completed):
- `model/<name>`: every parameter as its *global* tensor under its name in the unwrapped model
  (`canonical_name`), whatever layout trained it;
- `optim/<name>/{exp_avg,exp_avg_sq,step}`: the AdamW state in the same global form, from
  `torch.optim.AdamW` or from `HostAdamW` (the two are interchangeable; the fp32 master is the
  parameter itself);
- `rng/cpu`: the CPU generator state;
- `mop.json` (written by rank 0): the step, the data stream's position, the run's config.

Global views. DCP reshards by global tensor metadata, so each rank presents its local tensor as a
DTensor of the global shape, without communication:
- FSDP2-sharded weights already are DTensors over the world (`Shard(0)`);
- an expert partition (FSDP2 over the expert-replica group) is presented on a 2-D mesh
  `[expert, expert_replica]` (the expert mesh transposed, built without process groups) as
  `[Shard(0), Shard(0)]`: the partition's block of experts, then the replica's slice of it;
- the vocabulary shard is presented on the vocabulary mesh as `[Replicate(), Shard(0)]` of the
  unpadded `[V, H]` weight: its padding rows are cut off, and torch's chunking of V rows over P
  shards is exactly the `ceil(V/P)` rows per shard the vocabulary head uses;
- plain tensors (the reference strategy) are saved as they are.
Loading builds the same views over the new layout's tensors and lets DCP read what each rank
needs into them in place, so a checkpoint saved with any layout loads into any other.

Atomicity. Every rank writes into `step_<N>.partial`; DCP's save returns once the metadata is
written; rank 0 then writes `mop.json` and renames the directory to `step_<N>` (a rename is atomic
on one file system), and only then removes the oldest complete checkpoints beyond `keep`. A crash
at any point leaves every complete checkpoint as it was; `.partial` leftovers are removed by the
next save. Multi-node runs need `checkpoint.dir` on a file system all nodes share.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mop.config import Config, ConfigError
from mop.parallel.checkpointing import canonical_name
from mop.parallel.llep import ExpertParallel
from mop.parallel.mesh import DistLayout
from mop.parallel.vocab import VocabParallelHead

META = "mop.json"
PARTIAL = ".partial"


class GlobalViews:
    """For each parameter of a (parallelised) model: how its local tensors appear as global ones."""

    def __init__(self, model: torch.nn.Module, layout: DistLayout | None):
        self.names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
        self._view = {}
        self._expert_mesh = None
        expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertParallel) for p in m.parameters()}
        head = getattr(model, "lm_head", None)
        for param in model.parameters():
            if id(param) in expert_params:
                self._view[id(param)] = self._expert_view(param, layout)
            elif isinstance(head, VocabParallelHead) and param is head.weight:
                self._view[id(param)] = self._vocab_view(head, layout)
            elif isinstance(param, DTensor):
                self._view[id(param)] = _dtensor_view(param.device_mesh, param.placements, param.shape)
            else:
                self._view[id(param)] = lambda local: local

    def of(self, param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
        """The global view of `local` (a tensor shaped like `param`'s local shard; default: the param's)."""
        if local is None:
            local = param.to_local() if isinstance(param, DTensor) else param
        elif isinstance(local, DTensor):
            local = local.to_local()
        return self._view[id(param)](local.detach())

    def _expert_view(self, param: DTensor, layout: DistLayout):
        if self._expert_mesh is None:  # metadata only: no process groups are created
            transposed = layout.expert_mesh.mesh.t().contiguous()
            self._expert_mesh = DeviceMesh(layout.device.type, transposed, mesh_dim_names=("expert", "expert_replica"),
                                           _init_backend=False)
        experts = param.shape[0] * layout.layout.expert  # a partition holds E/Ep experts
        return _dtensor_view(self._expert_mesh, (Shard(0), Shard(0)), (experts, *param.shape[1:]))

    @staticmethod
    def _vocab_view(head: VocabParallelHead, layout: DistLayout):
        ring = head.ring
        real = ring.valid_columns(ring.rank, head.weight.shape[0])
        view = _dtensor_view(layout.vocab_mesh, (Replicate(), Shard(0)), (ring.vocab, head.weight.shape[1]))
        return lambda local: view(local[:real])


def _dtensor_view(mesh: DeviceMesh, placements, shape):
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return lambda local: DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _state(model, optimizer, host, views: GlobalViews, with_optimizer: bool) -> dict:
    state = {"model": {views.names[id(p)]: views.of(p) for p in model.parameters()}, "rng": {"cpu": torch.get_rng_state()}}
    if with_optimizer:
        state["optim"] = {views.names[id(p)]: _optimizer_state(p, optimizer, host, views) for p in model.parameters()}
    return state


def _optimizer_state(param, optimizer, host, views: GlobalViews) -> dict:
    if host is not None:
        saved = host.state_of(param)
    else:
        if param not in optimizer.state:  # a fresh optimizer (resume): create the state to load into
            optimizer.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        saved = optimizer.state[param]
    return {"exp_avg": views.of(param, saved["exp_avg"]), "exp_avg_sq": views.of(param, saved["exp_avg_sq"]),
            "step": saved["step"]}


def checkpoint_dir(config: Config, run_dir: Path) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def save(directory: Path, step: int, model, optimizer, host, views: GlobalViews, data_state: dict,
         config: Config, keep: int) -> Path:
    """Write checkpoint `step_<step>` atomically (collective over all ranks) and prune to the newest `keep`."""
    final = directory / f"step_{step}"
    partial = directory / f"step_{step}{PARTIAL}"
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        for leftover in directory.glob(f"step_*{PARTIAL}"):
            shutil.rmtree(leftover)
        partial.mkdir(parents=True)
    _barrier()
    with _quiet_if_single_process():
        dcp.save(_state(model, optimizer, host, views, with_optimizer=True), checkpoint_id=partial,
                 no_dist=not dist.is_initialized())
    if main:
        meta = {"step": step, "data": data_state, "config": asdict(config), "has_optimizer": True}
        (partial / META).write_text(json.dumps(meta, indent=1))
        if final.exists():  # a complete checkpoint of this step from an earlier attempt: replace it
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def save_model_only(path: Path, model, config: Config) -> None:
    """A step-0 checkpoint holding only model weights (an import, e.g. from Hugging Face); one process."""
    partial = path.with_name(path.name + PARTIAL)
    views = GlobalViews(model, None)
    with _quiet_if_single_process():
        dcp.save(_state(model, None, None, views, with_optimizer=False), checkpoint_id=partial, no_dist=True)
    meta = {"step": 0, "data": None, "config": asdict(config), "has_optimizer": False}
    (partial / META).write_text(json.dumps(meta, indent=1))
    partial.rename(path)


@contextmanager
def _quiet_if_single_process():
    """DCP warns on every single-process save/load that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def resolve_resume(config: Config, run_dir: Path | None) -> Path | None:
    """The checkpoint to resume from (`checkpoint.resume`), or None to start fresh."""
    choice = config.checkpoint.resume
    if not choice:
        return None
    if choice == "latest":
        found = complete_checkpoints(checkpoint_dir(config, run_dir)) if run_dir is not None else []
        return found[-1] if found else None
    path = Path(choice)
    if not (path / META).is_file():
        raise ConfigError("checkpoint.resume", f"{path} is not a complete mop checkpoint (no {META}); "
                          "pass a step_<N> directory, 'latest', or '' to start fresh")
    return path


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


def check_compatible(meta: dict, config: Config, path: Path) -> None:
    """The checkpoint's model must be the configured one (the layout may differ)."""
    saved = meta["config"]["model"]
    for key, value in asdict(config.model).items():
        if saved.get(key) != value:
            raise ConfigError(f"model.{key}", f"checkpoint {path} was saved with model.{key}={saved.get(key)!r}, "
                              f"this run has {value!r}; use the checkpoint's model settings")


def load(path: Path, model, optimizer, host, views: GlobalViews, with_optimizer: bool = True) -> dict:
    """Load checkpoint `path` into the model (and the optimizer, if asked and the checkpoint has its
    state) in place; returns its meta."""
    meta = read_meta(path)
    state = _state(model, optimizer, host, views, with_optimizer=with_optimizer and meta["has_optimizer"])
    with _quiet_if_single_process():
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=not dist.is_initialized())
    torch.set_rng_state(state["rng"]["cpu"])
    if host is not None:
        host.masters_from_working()
    return meta
