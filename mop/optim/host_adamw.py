"""Host-resident AdamW, updated shard by shard as gradients become final, exact under clipping.

State. For every parameter shard this rank owns (the local tensor of an FSDP2 DTensor, or a plain
tensor), host memory holds the fp32 master weight, the AdamW moments and the step count (pinned
on CUDA machines). The device keeps only the working weight the model computes with. On a
CPU-only machine an fp32 working weight already lives in host memory and is its own master.

One optimizer step:
1. `begin_step(lr)`: the step's learning rate (from the schedule).
2. `gradient_ready(param, grad)`, once per shard, as soon as its gradient is final (after its
   reduce-scatter): the gradient is copied to the host and a worker thread applies a speculative
   AdamW update with torch's fused kernel (`torch._fused_adamw_`), after backing the shard's
   state up. Nothing waits for the rest of the backward.
3. `finish(grad_norm, max_norm)`, once the global gradient norm is known: the speculation
   assumed no clipping. If the norm is not finite, every shard is restored from its backup (the
   step is skipped, state untouched). If clipping applies (max_norm / norm < 1), every shard is
   restored and updated again with its gradient scaled by the clip coefficient: a rollback.
   Otherwise the speculative updates stand. Finally the masters are copied into the working weights.
   After a step that clipped, the next step does not speculate (clipping tends to persist, and
   its speculation would only be rolled back): its shards are updated in `finish`.

Invariant: after `finish` the state is exactly what `torch.optim.AdamW` reaches with the clipped
gradients (or untouched on a skipped step), whatever the order in which shards arrived; the
speculation only changes when the work happens.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _to_host(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 host copy of a gradient; on a CPU-only machine the gradient already is one.

    Holding the gradient tensor itself is safe: the trainer releases gradients (set_to_none) and
    never writes into them between the hand-over and `finish`.
    """
    if grad.device.type == "cpu" and grad.dtype == torch.float32:
        return grad
    host = torch.empty(grad.shape, dtype=torch.float32, pin_memory=torch.cuda.is_available())
    host.copy_(grad)
    return host


@dataclass
class ShardState:
    """Host state of one parameter shard."""

    working: torch.Tensor  # the device tensor the model reads
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # float32 scalar, as the fused kernel wants it
    weight_decay: float
    grad: torch.Tensor | None = None
    backup: tuple[torch.Tensor, ...] | None = None
    pending: Future | None = field(default=None, repr=False)


class HostAdamW:
    """See the module docstring. `groups`: dicts with "params" and "weight_decay", as for torch.optim."""

    def __init__(self, groups: list[dict], betas=(0.9, 0.999), eps: float = 1e-8, workers: int = 1,
                 speculative: bool = True):
        self.speculative = speculative  # False: update only in finish, once the norm is known (no backups)
        self.last_clipped = False
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.lr = 0.0
        pin = torch.cuda.is_available()
        self.shards: list[ShardState] = []  # in group order: the state_dict order
        self._by_param: dict[int, ShardState] = {}
        for group in groups:
            for param in group["params"]:
                working = _local(param.detach())
                if working.device.type == "cpu" and working.dtype == torch.float32:
                    master = working  # host and device are the same memory: the working weight is the master
                else:
                    master = torch.empty(working.shape, dtype=torch.float32, pin_memory=pin)
                    master.copy_(working)
                shard = ShardState(working, master, torch.zeros_like(master), torch.zeros_like(master),
                                   torch.zeros((), dtype=torch.float32), group["weight_decay"])
                self.shards.append(shard)
                self._by_param[id(param)] = shard
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="host-adamw")
        self.rollbacks = 0

    def shard_of(self, param: torch.Tensor) -> ShardState:
        return self._by_param[id(param)]

    def begin_step(self, lr: float) -> None:
        self.lr = lr

    def gradient_ready(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """`param`'s gradient is final: copy it to the host and start its speculative update."""
        shard = self.shard_of(param)
        shard.grad = _to_host(_local(grad).detach())
        # After a clipped step the next one usually clips too: wait for the norm instead of
        # speculating work that would be rolled back.
        if self.speculative and not self.last_clipped:
            shard.pending = self.pool.submit(self._speculate, shard)

    def _speculate(self, shard: ShardState) -> None:
        shard.backup = (shard.master.clone(), shard.exp_avg.clone(), shard.exp_avg_sq.clone(), shard.step.clone())
        self._update(shard, shard.grad)

    def _update(self, shard: ShardState, grad: torch.Tensor) -> None:
        shard.step += 1  # the fused kernel reads the already-incremented count, as torch.optim.AdamW passes it
        torch._fused_adamw_([shard.master], [grad], [shard.exp_avg], [shard.exp_avg_sq], [], [shard.step],
                            lr=self.lr, beta1=self.beta1, beta2=self.beta2, weight_decay=shard.weight_decay,
                            eps=self.eps, amsgrad=False, maximize=False)

    def finish(self, grad_norm: float, max_norm: float) -> bool:
        """Validate the speculative updates against the global norm; returns True if shards were rolled back."""
        for shard in self.shards:
            if shard.pending is not None:
                shard.pending.result()
        coefficient = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0
        redo = not math.isfinite(grad_norm) or coefficient < 1.0
        rolled_back = redo and math.isfinite(grad_norm) and any(s.backup is not None for s in self.shards)
        for shard in self.shards:
            if shard.grad is None:
                continue
            if shard.backup is None:  # not speculated: the update happens now, exactly once
                if math.isfinite(grad_norm):
                    self._update(shard, shard.grad if coefficient == 1.0 else shard.grad * coefficient)
            elif redo:
                for current, saved in zip((shard.master, shard.exp_avg, shard.exp_avg_sq, shard.step), shard.backup):
                    current.copy_(saved)
                if math.isfinite(grad_norm):
                    self._update(shard, shard.grad * coefficient)
            if shard.working is not shard.master:
                shard.working.copy_(shard.master)
            shard.grad, shard.backup, shard.pending = None, None, None
        self.rollbacks += int(rolled_back)
        self.last_clipped = math.isfinite(grad_norm) and coefficient < 1.0
        return rolled_back

    def state_dict(self) -> dict:
        return {"shards": [{"master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "step": s.step}
                           for s in self.shards], "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shards"]) != len(self.shards):
            raise ValueError(f"optimizer state holds {len(state['shards'])} shards, this model has {len(self.shards)}")
        for shard, saved in zip(self.shards, state["shards"]):
            for key in ("master", "exp_avg", "exp_avg_sq", "step"):
                getattr(shard, key).copy_(saved[key])
            if shard.working is not shard.master:
                shard.working.copy_(shard.master)
        self.rollbacks = state["rollbacks"]
