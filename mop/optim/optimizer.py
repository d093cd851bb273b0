"""The trainer's one optimizer interface, with two implementations: torch AdamW on the device
(`DeviceAdamW`) and the host pipeline (`HostOptimizer`: `HostAdamW` fed by `GradientFeed`).

The trainer, `mop bench optimizer` and the tests call it once per phase of a step:
1. `begin_step(lr)`: the step's learning rate (from the schedule).
2. `before_forward()`: before the step's first forward. Host: wait for the previous step's
   updates of the parameters outside the blocks (each block waits for its own in a pre-hook).
3. per micro-batch, `before_backward(last)` and `after_backward()`: the gradients are ready.
   Device: autograd accumulates them. Host: each is handed over as soon as it is reduced, the
   last micro-batch's make them final (`mop.optim.pipeline`).
4. `step(max_norm)`: the global gradient norm (one all-reduce of the ranks' squared norms, each
   replicated shard counted once), clipping, and the update, or its skip when the norm is not
   finite; the device gradients are released. Returns the step record's optimizer fields.
5. `synchronize()`: before the weights are read (host: the last step's deferred updates).
Checkpoints read and write the state through `master(param)` (the tensor a parameter's saved
weight lives in: the host's fp32 master, or the parameter itself) and `moments(param)`, and call
`weights_written()` after writing masters (host: the working weights are copied from them).

Invariant: both implementations reach the same state as `torch.optim.AdamW` over the clipped
gradients (`tests/test_host_adamw.py`); they differ in where the state lives and when the work runs.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mop.config import Config, ConfigError
from mop.optim.host_adamw import HostAdamW
from mop.optim.pipeline import GradientFeed


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups with weight decay on matrices only (norms, 1-D, are not decayed): one group per
    (decayed or not, kind of shard), the kinds being plain tensors and the DTensors of one mesh (the
    world's, an expert replica group's). torch's multi-tensor kernels, CUDA's default, take one kind
    per call and see one group at a time; a group mixing kinds fails at the first step."""
    groups: dict[tuple, list] = {}
    for param in trained_parameters(model):
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        groups.setdefault((param.dim() >= 2, mesh), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decayed else 0.0}
            for (decayed, _), params in groups.items()]


def trained_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters the optimizer updates: all of them, but for a LoRA run's frozen base."""
    return [param for param in model.parameters() if param.requires_grad]


def global_norm(local_squared: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """The square root of the sum over the ranks of `group` (None: one process) of each rank's squared norm."""
    if group is not None:
        # Host gradients (FSDP2's CPU offload, the host optimizer) give a host value; NCCL reduces device tensors only.
        local_squared = local_squared.to(device)
        dist.all_reduce(local_squared, group=group)
    return local_squared.sqrt()


class Optimizer(ABC):
    """See the module docstring. `group`: the ranks whose shards make the model (None: one process);
    `replicas`: the number of ranks holding each replicated parameter, by id (its norm counts once)."""

    on_host: bool
    """Whether the fp32 state (masters and moments) lives in host memory."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, replicas: dict[int, int]):
        self.group, self.device, self.replicas = group, device, replicas

    @abstractmethod
    def begin_step(self, lr: float) -> None: ...

    def before_forward(self) -> None:
        pass

    def before_backward(self, last: bool) -> None:
        pass

    def after_backward(self) -> None:
        pass

    @abstractmethod
    def step(self, max_norm: float) -> dict:
        """`grad_norm` and `skipped`, and what else the implementation reports."""

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        """End the optimizer's worker threads; it is not used after."""

    @abstractmethod
    def master(self, param: torch.Tensor) -> torch.Tensor | None:
        """The tensor holding `param`'s saved weight, shaped like its local shard (None: the parameter,
        as for every frozen one)."""

    @abstractmethod
    def moments(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """`exp_avg`, `exp_avg_sq` (shaped like the local shard) and `step`, created if not there yet."""

    def weights_written(self) -> None:
        """The masters were written (initial values, a checkpoint): bring the working weights along."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of the optimizer's own state (moments, masters apart from the weights, rollback copies)."""

    def held_gradient_bytes(self) -> int:
        """Bytes of gradients the optimizer holds in host memory right now (handed over, not yet applied)."""
        return 0


class DeviceAdamW(Optimizer):
    """torch AdamW beside the parameters: gradients accumulate until `step`, which clips and updates."""

    on_host = False

    def __init__(self, adamw: torch.optim.AdamW, model: torch.nn.Module, group, device, replicas):
        super().__init__(group, device, replicas)
        self.adamw, self.model = adamw, model

    def begin_step(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def step(self, max_norm: float) -> dict:
        grad_norm = self.clip_gradients(max_norm)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "skipped": skipped}

    def clip_gradients(self, max_norm: float) -> float:
        """The global gradient norm; gradients are scaled by max_norm / norm when it exceeds max_norm.

        Every gradient element lives on exactly one rank except those of replicated shards (the
        vocabulary shard); the squared norm is the sum over ranks of the local squared norms, each
        divided by its replication. Same formula as torch's `clip_grad_norm_`.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        weights = [1.0 / self.replicas.get(id(p), 1) for p in params]
        squared = sum(w * n.float().square() for w, n in zip(weights, torch._foreach_norm(local)))
        norm = global_norm(squared, self.group, self.device)
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(local, scale.to(local[0].device, local[0].dtype))
        return norm.item()

    def master(self, param):
        return None

    def moments(self, param):
        if param not in self.adamw.state:  # a fresh optimizer (resume): create the state to load into
            self.adamw.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                       "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        return self.adamw.state[param]

    def state_bytes(self) -> int:
        """The fp32 moments, whether or not the first step has created them yet."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trained_parameters(self.model)]
        return 2 * sum(p.numel() * 4 for p in local)


class HostOptimizer(Optimizer):
    """`HostAdamW` fed during the backward by a `GradientFeed` (module docstring of `mop.optim.host_adamw`)."""

    on_host = True

    def __init__(self, host: HostAdamW, model: torch.nn.Module, group, device):
        super().__init__(group, device, {})
        self.host, self.model = host, model
        self.feed = GradientFeed(model, host)

    def begin_step(self, lr: float) -> None:
        self.host.begin_step(lr)

    def before_forward(self) -> None:
        self.feed.before_forward()

    def before_backward(self, last: bool) -> None:
        self.feed.arm(last)

    def after_backward(self) -> None:
        self.feed.flush()

    def step(self, max_norm: float) -> dict:
        """Validate the speculative updates against the global norm of the host gradients (the
        device ones were released at hand-over). `optimizer_exposed_s` is the optimizer time on
        this step's critical path: waiting for the last host gradients' norms, `finish` (deciding
        and queueing the updates), and the time this step's forward waited for the previous step's
        updates."""
        start = time.perf_counter()
        local_squared = self.host.local_squared_norm()
        exposed = time.perf_counter() - start
        grad_norm = global_norm(local_squared, self.group, self.device).item()  # the host applies the clip
        start = time.perf_counter()
        redone = self.host.finish(grad_norm, max_norm)
        waited = self.feed.take_wait_s()
        exposed += time.perf_counter() - start + waited
        self.model.zero_grad(set_to_none=True)
        skipped = not math.isfinite(grad_norm)
        return {"grad_norm": grad_norm, "skipped": skipped, "rollback": redone and not skipped,
                "optimizer_exposed_s": exposed, "optimizer_forward_wait_s": waited,
                "gradients_handed_over_in_backward": self.feed.early}

    def synchronize(self) -> None:
        self.host.synchronize()

    def close(self) -> None:
        self.host.close()

    def master(self, param):
        return self.host.state_of(param)["master"] if param.requires_grad else None

    def moments(self, param):
        return self.host.state_of(param)

    def weights_written(self) -> None:
        self.host.working_from_masters()

    def held_gradient_bytes(self) -> int:
        return self.host.lent_gradient_bytes()

    def state_bytes(self) -> int:
        """Moments, rollback copies, and the master where it is not the working weight."""
        total = 0
        for shard in self.host.shards:
            tensors = [shard.exp_avg, shard.exp_avg_sq, *(shard.spare or ())]
            if shard.master is not shard.working:
                tensors.append(shard.master)
            total += sum(t.nbytes for t in tensors)
        return total


def check_settings(config: Config, world: int) -> None:
    """AdamW's decays, and the host optimizer's own switch only with the host optimizer."""
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(config.optim, key) < 1:
            raise ConfigError(f"optim.{key}", f"must be in [0, 1), got {getattr(config.optim, key)}")
    if not config.optim.speculative and not config.optim.offload:
        raise ConfigError("optim.speculative", "applies to the host optimizer only; set --optim.offload=true or "
                          "drop --optim.speculative=false")
