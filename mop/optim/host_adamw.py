"""Host-resident AdamW, updated shard by shard as gradients become final, exact under clipping.

State. For every parameter shard this rank owns (the local tensor of an FSDP2 DTensor, or a plain
tensor), host memory holds the fp32 master weight, the AdamW moments, the step count and a spare
copy of the master and moments for rollback (pinned on CUDA machines, allocated once). A shard
is updated in pieces of at most `piece_elements` (flat views; the update is elementwise), so the
work still in flight when the norm arrives is one piece, not one whole shard. The device keeps only the
working weight the model computes with. On a CPU-only machine an fp32 working weight already
lives in host memory and is its own master.

One optimizer step:
1. `begin_step(lr)`: the step's learning rate (from the schedule).
2. `gradient_ready(param, grad)`, once per shard, as soon as its gradient is final (after its
   reduce-scatter; `GradientFeed` calls it from FSDP2's post-accumulate-grad hook). On CUDA the
   gradient is copied into the shard's pinned host buffer on the current stream (FSDP2's
   post-reduce stream inside the hook) and an event is recorded; the worker waits on that event,
   not the Python thread. A worker thread then, piece by piece, copies the state into the spare
   and applies a speculative AdamW update with torch's fused kernel (`torch._fused_adamw_`), using
   the step count + 1 (the count itself is only committed in `finish`). Nothing waits for the
   rest of the backward.
3. `finish(grad_norm, max_norm)`, once the global gradient norm is known: the speculation
   assumed no clipping. If the norm is not finite, every shard is restored from its spare (the
   step is skipped, state untouched). If clipping applies (max_norm / norm < 1), every shard is
   restored and updated again with its gradient scaled by the clip coefficient: a rollback.
   Otherwise the speculative updates stand. Pieces whose speculation had not started yet are
   cancelled and updated directly with the known coefficient (no spare copy). The step count
   advances unless the step is skipped. Finally the masters are copied into the working
   weights (asynchronously on CUDA, on the current stream, so the next forward is ordered after).
   After a step that clipped, the next step does not speculate (clipping tends to persist, and
   its speculation would only be rolled back): its shards are updated in `finish`.

Invariant: after `finish` the state is exactly what `torch.optim.AdamW` reaches with the clipped
gradients (or untouched on a skipped step), whatever the order in which shards arrived; the
speculation only changes when the work happens. A host master is written only by the worker of
the next step, which waits on a gradient event that follows the next forward on the device, so
the asynchronous copy-back has always finished reading it.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An fp32 host buffer shaped like `tensor`, pinned where a device can copy into it asynchronously."""
    return torch.empty(tensor.shape, dtype=torch.float32, pin_memory=torch.cuda.is_available())


def _pieces(tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Flat views of at most `size` elements covering `tensor` (the tensor itself if not viewable flat)."""
    return list(tensor.view(-1).split(size)) if tensor.is_contiguous() else [tensor]


@dataclass
class ShardState:
    """Host state of one parameter shard."""

    working: torch.Tensor  # the device tensor the model reads
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # float32 scalar, as the fused kernel wants it
    weight_decay: float
    piece_elements: int
    spare: tuple[torch.Tensor, ...] | None = None  # rollback copies of master and moments, when speculating
    grad: torch.Tensor | None = None  # this step's host gradient, once handed over
    grad_copied: torch.Event | None = None  # set while an asynchronous device-to-host copy is in flight
    host_grad: torch.Tensor | None = None  # persistent pinned buffer for device gradients
    next_step: torch.Tensor | None = None  # the count this step's update uses
    speculated: list[bool] = field(default_factory=list)  # per piece
    pending: list[Future] = field(default_factory=list, repr=False)

    pieces: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # views of (master, exp_avg, exp_avg_sq)
    spare_pieces: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    grad_pieces: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self):
        # The state tensors are never reallocated (loading copies into them), so the views stay valid.
        self.pieces = self._split(self.master, self.exp_avg, self.exp_avg_sq)
        if self.spare is not None:
            self.spare_pieces = self._split(*self.spare)

    def _split(self, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        return list(zip(*(_pieces(t, self.piece_elements) for t in tensors)))

    def wait_for_grad(self) -> None:
        event = self.grad_copied
        if event is not None:
            event.synchronize()


class HostAdamW:
    """See the module docstring. `groups`: dicts with "params" and "weight_decay", as for torch.optim."""

    def __init__(self, groups: list[dict], betas=(0.9, 0.999), eps: float = 1e-8, workers: int = 1,
                 speculative: bool = True, piece_elements: int = 1 << 18):
        self.speculative = speculative  # False: update only in finish, once the norm is known (no rollback buffers)
        self.last_clipped = False
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.lr = 0.0
        self.shards: list[ShardState] = []  # in group order
        self._by_param: dict[int, ShardState] = {}
        for group in groups:
            for param in group["params"]:
                working = _local(param.detach())
                if working.device.type == "cpu" and working.dtype == torch.float32:
                    master = working  # host and device are the same memory: the working weight is the master
                else:
                    master = _host_like(working)
                    master.copy_(working)
                shard = ShardState(working, master, torch.zeros_like(master), torch.zeros_like(master),
                                   torch.zeros((), dtype=torch.float32), group["weight_decay"], piece_elements,
                                   # allocated and touched now, so no step pays the page faults
                                   spare=tuple(_host_like(master).zero_() for _ in range(3)) if speculative else None)
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
        grad = _local(grad).detach()
        if grad.device.type == "cpu" and grad.dtype == torch.float32:
            # Already a host fp32 tensor; the trainer releases gradients (set_to_none) and never
            # writes into them between the hand-over and `finish`.
            shard.grad = grad
        else:
            if shard.host_grad is None:
                shard.host_grad = _host_like(grad)
            shard.host_grad.copy_(grad, non_blocking=True)
            shard.grad = shard.host_grad
            if grad.device.type != "cpu":
                shard.grad_copied = torch.Event(grad.device)
                shard.grad_copied.record()
        shard.next_step = shard.step + 1  # the fused kernel reads the incremented count, as torch.optim.AdamW passes it
        shard.grad_pieces = _pieces(shard.grad, shard.piece_elements)
        count = len(shard.pieces)
        shard.speculated = [False] * count
        # After a clipped step the next one usually clips too: wait for the norm instead of
        # speculating work that would be rolled back.
        if self.speculative and not self.last_clipped:
            shard.pending = [self.pool.submit(self._speculate, shard, index) for index in range(count)]

    def _speculate(self, shard: ShardState, index: int) -> None:
        shard.wait_for_grad()
        state = shard.pieces[index]
        torch._foreach_copy_(list(shard.spare_pieces[index]), list(state))
        shard.speculated[index] = True
        self._update(shard, state, shard.grad_pieces[index])

    def _update(self, shard: ShardState, state: tuple[torch.Tensor, ...], grad: torch.Tensor) -> None:
        master, exp_avg, exp_avg_sq = state
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [shard.next_step],
                            lr=self.lr, beta1=self.beta1, beta2=self.beta2, weight_decay=shard.weight_decay,
                            eps=self.eps, amsgrad=False, maximize=False)

    def finish(self, grad_norm: float, max_norm: float) -> bool:
        """Validate the speculative updates against the global norm; returns True if pieces were rolled back."""
        for shard in self.shards:
            for future in shard.pending:
                # A speculation the worker has not started yet is cancelled: now that the norm is
                # known, the loop below updates that piece directly, with no rollback copy.
                if not future.cancel():
                    future.result()
        finite = math.isfinite(grad_norm)
        coefficient = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 and finite else 1.0
        redo = not finite or coefficient < 1.0
        rolled_back = redo and finite and any(any(s.speculated) for s in self.shards)
        for shard in self.shards:
            if shard.grad is not None:
                shard.wait_for_grad()
                self._settle(shard, finite, coefficient)
                if shard.working is not shard.master:
                    shard.working.copy_(shard.master, non_blocking=True)
            shard.grad, shard.grad_copied, shard.grad_pieces, shard.speculated, shard.pending = None, None, [], [], []
        self.rollbacks += int(rolled_back)
        self.last_clipped = finite and coefficient < 1.0
        return rolled_back

    def _settle(self, shard: ShardState, finite: bool, coefficient: float) -> None:
        """Bring every piece of `shard` to the state the validated step defines."""
        grads = shard.grad_pieces if coefficient == 1.0 else _pieces(shard.grad * coefficient, shard.piece_elements)
        spares = shard.spare_pieces or [None] * len(grads)
        for state, spare, piece_grad, speculated in zip(shard.pieces, spares, grads, shard.speculated):
            if speculated and (not finite or coefficient < 1.0):
                torch._foreach_copy_(list(state), list(spare))  # roll back
                speculated = False
            if not speculated and finite:
                self._update(shard, state, piece_grad)
        if finite:
            shard.step.copy_(shard.next_step)

    def state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """`param`'s AdamW state, named as torch.optim.AdamW names it (local shard tensors, loadable in place)."""
        shard = self.shard_of(param)
        return {"exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq, "step": shard.step}

    def masters_from_working(self) -> None:
        """After the working weights were loaded (a checkpoint): make the masters equal them."""
        for shard in self.shards:
            if shard.working is not shard.master:
                shard.master.copy_(shard.working)
