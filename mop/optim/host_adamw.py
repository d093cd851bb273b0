"""Host-resident AdamW, updated shard by shard as gradients become final, exact under clipping.

State. For every parameter shard this rank owns (the local tensor of an FSDP2 DTensor, or a plain
tensor), host memory holds the fp32 master weight, the AdamW moments, the step count and a spare
copy of the master and moments for rollback (pinned on CUDA machines, allocated once). A shard
is speculated in pieces of at most `piece_elements` (flat views; the update is elementwise), so
that speculation not started when the norm arrives is cancelled piece by piece and those pieces
need no rollback copy. The device keeps only the working weight the model computes with (bf16
under `train.dtype = "bfloat16"`: 2 bytes per parameter). On a CPU-only machine an fp32 working
weight already lives in host memory and is its own master.

One optimizer step:
1. `begin_step(lr)`: the step's learning rate (from the schedule).
2. `gradient_ready(param, grad, last)`, once per shard and micro-batch, as soon as its gradient
   is reduced (`GradientFeed` calls it from FSDP2's post-accumulate-grad hook and releases the
   device gradient right after: the device never accumulates gradients, and holds each one only
   from its reduce-scatter to its copy). On CUDA the gradient is copied into the shard's pinned
   staging buffer on the current stream (FSDP2's post-reduce stream inside the hook) and an event
   is recorded; the worker thread waits on that event, not the Python thread, and adds the copy
   into the shard's fp32 host gradient (on a CPU machine the first fp32 gradient is lent, not
   copied). A bf16 weight's gradient arrives in bf16: FSDP2 reduce-scatters in fp32 and then
   rounds the shard to the parameter's dtype (the paper's 2 bytes per parameter); the host sums
   micro-batches in fp32. With `last` (or at `gradients_final`, for a shard the last micro-batch
   did not reach), the host gradient is final: a thread of its own computes its squared norm (for
   clipping: `local_squared_norm`) and the worker, piece by piece, copies the state into the spare and
   applies a speculative AdamW update with torch's fused kernel (`torch._fused_adamw_`), using
   the step count + 1 (the count itself is only committed in `finish`). Nothing waits for the
   rest of the backward.
3. `finish(grad_norm, max_norm)`, once the global gradient norm is known, decides and returns at
   once: the speculation assumed no clipping. If the norm is not finite, every shard is restored
   from its spare (the step is skipped, state untouched). If clipping applies (max_norm / norm < 1),
   every speculated piece is restored and updated again with its gradient scaled by the clip
   coefficient: a rollback. Otherwise the speculative updates stand. Pieces whose speculation had
   not started are cancelled and updated directly with the known coefficient (no spare copy). The
   step count advances unless the step is skipped. This settling, and the copy of each master into
   its working weight, runs on the worker thread(s), one shard after another in the forward's
   order (`settle_in_order`). On CUDA the copy runs on a side stream and the worker waits for it
   before the shard counts as settled: FSDP2 gathers a block's shards on its own streams, which
   are ordered after the compute stream only once per forward (at the root), so the copy must be
   complete, not merely queued, when the forward reaches the block. The side stream needs no
   ordering against the compute stream: `finish` comes after the norm, a host value, so every
   earlier read of the working weights has run.
4. `wait_for(params)` blocks until those shards are settled; `GradientFeed` calls it just before
   the module that reads them runs its next forward (and before FSDP2 gathers it), so the update
   of a later block overlaps the next forward of the earlier ones. `synchronize()` waits for all
   (before a checkpoint is written or the state is read).
After a step that clipped, the next step does not speculate (clipping tends to persist, and its
speculation would only be rolled back): its shards are updated after the norm is known, still off
the critical path, overlapped with the next forward. So clipping never switches the overlap off.

Invariant: once a shard is settled its state is exactly what `torch.optim.AdamW` reaches with the
clipped gradients (or untouched on a skipped step), whatever the order in which shards arrived or
were settled, and its working weight equals its master; the speculation and the deferral only
change when the work happens. A shard's next hand-over waits for its settling.
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
    replicas: int = 1  # ranks holding this same shard (the vocabulary shard): its norm counts once
    spare: tuple[torch.Tensor, ...] | None = None  # rollback copies of master and moments, when speculating
    grad: torch.Tensor | None = None  # this step's fp32 host gradient (accumulated over micro-batches)
    arrived: Future | None = field(default=None, repr=False)  # the last hand-over's copy/accumulation into `grad`
    squared_norm: Future | None = field(default=None, repr=False)  # of the final `grad`
    host_grad: torch.Tensor | None = None  # persistent fp32 host buffer for device gradients
    staging: torch.Tensor | None = None  # persistent pinned buffer a device gradient is copied into
    next_step: torch.Tensor | None = None  # the count this step's update uses
    lr: float = 0.0  # this step's learning rate (the next step may begin before this one is settled)
    speculated: list[bool] = field(default_factory=list)  # per piece
    pending: list[Future] = field(default_factory=list, repr=False)  # this step's speculation, per piece
    settled: Future | None = field(default=None, repr=False)  # the last step's settling

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

    def wait_arrived(self) -> None:
        if self.arrived is not None:
            self.arrived.result()

    def wait_settled(self) -> None:
        if self.settled is not None:
            self.settled.result()  # re-raises a worker's error here


class HostAdamW:
    """See the module docstring. `groups`: dicts with "params" and "weight_decay", as for torch.optim;
    `replicas`: the number of ranks holding each replicated parameter, by id (its norm counts once)."""

    def __init__(self, groups: list[dict], betas=(0.9, 0.999), eps: float = 1e-8, workers: int = 1,
                 speculative: bool = True, piece_elements: int = 1 << 20, replicas: dict[int, int] | None = None):
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
                                   replicas=(replicas or {}).get(id(param), 1),
                                   # allocated and touched now, so no step pays the page faults
                                   spare=tuple(_host_like(master).zero_() for _ in range(3)) if speculative else None)
                self.shards.append(shard)
                self._by_param[id(param)] = shard
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="host-adamw")
        # Arrivals (accumulation into the host gradients) and their norms on a thread of their own,
        # in hand-over order: the global norm, on the step's critical path, never queues behind
        # speculative updates.
        self.arrivals = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-adamw-arrivals")
        self._copy_streams: dict[torch.device, torch.Stream] = {}  # per device, for the copies back
        self.rollbacks = 0

    def lent_gradient_bytes(self) -> int:
        """Bytes of the gradients the optimizer holds as they were handed over (on a CPU-only machine
        the first fp32 gradient is lent, not copied): host memory a GPU machine would have copied
        them into. The memory benchmarks subtract them from what a device would hold."""
        return sum(s.grad.untyped_storage().nbytes() for s in self.shards
                   if s.grad is not None and s.grad is not s.host_grad)

    def shard_of(self, param: torch.Tensor) -> ShardState:
        return self._by_param[id(param)]

    def begin_step(self, lr: float) -> None:
        self.lr = lr

    def gradient_ready(self, param: torch.Tensor, grad: torch.Tensor, last: bool = True) -> None:
        """One micro-batch's gradient of `param` (its local shard), handed over once it is reduced.

        It is copied to the host and added to the step's fp32 host gradient; the caller may
        release its own reference at once. With `last` (the step's last micro-batch) the host
        gradient is final: its squared norm and its speculative update are queued.
        """
        shard = self.shard_of(param)
        shard.wait_settled()  # the last step's update of this shard (normally long done: the forward waited)
        grad = _local(grad).detach()
        first = shard.grad is None
        if first:
            shard.lr = self.lr
            shard.next_step = shard.step + 1  # the fused kernel reads the incremented count, as torch.optim.AdamW passes it
        if grad.device.type == "cpu" and grad.dtype == torch.float32 and first:
            # Already a host fp32 tensor, lent to the optimizer until the shard is settled (a
            # clipped step scales it in place); the feed has released the parameter's reference.
            shard.grad = grad
        else:
            incoming, copied = self._host_copy(shard, grad)
            if shard.grad is None:
                if shard.host_grad is None:
                    shard.host_grad = _host_like(grad)
                shard.grad = shard.host_grad
            previous = shard.arrived
            shard.arrived = self.arrivals.submit(self._accumulate, shard, previous, incoming, copied, first)
        if last:
            self._queue_update(shard)

    def _host_copy(self, shard: ShardState, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Event | None]:
        """`grad` in host memory: itself when it is there already, else an asynchronous copy into the
        shard's pinned staging buffer, queued on the gradient device's current stream (FSDP2's
        post-reduce stream inside its hook), and the event that marks its completion."""
        if grad.device.type == "cpu":
            return grad, None
        if shard.staging is None:
            shard.staging = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        shard.wait_arrived()  # the previous micro-batch's accumulation has read the staging buffer
        shard.staging.copy_(grad, non_blocking=True)
        stream = torch.accelerator.current_stream(grad.device)
        grad.record_stream(stream)  # the caller releases `grad`: its memory waits for the copy
        return shard.staging, stream.record_event()

    @staticmethod
    def _accumulate(shard: ShardState, previous: Future | None, incoming: torch.Tensor, copied, first: bool) -> None:
        if previous is not None:
            previous.result()
        if copied is not None:
            copied.synchronize()
        if first:
            shard.grad.copy_(incoming)
        else:
            shard.grad.add_(incoming)

    def _queue_update(self, shard: ShardState) -> None:
        """The host gradient is final: queue its squared norm and (unless the last step clipped) its speculation."""
        shard.grad_pieces = _pieces(shard.grad, shard.piece_elements)
        count = len(shard.pieces)
        shard.speculated = [False] * count
        shard.squared_norm = self.arrivals.submit(self._squared_norm, shard)
        # After a clipped step the next one usually clips too: wait for the norm instead of
        # speculating work that would be rolled back.
        if self.speculative and not self.last_clipped:
            shard.pending = [self.pool.submit(self._speculate, shard, index) for index in range(count)]

    def gradients_final(self) -> None:
        """The step's last backward is over: a shard whose gradient came from earlier micro-batches
        only (it was handed over, but not in the last one) is final too."""
        for shard in self.shards:
            if shard.grad is not None and shard.squared_norm is None:
                self._queue_update(shard)

    @staticmethod
    def _squared_norm(shard: ShardState) -> torch.Tensor:
        shard.wait_arrived()
        return torch._foreach_norm([shard.grad])[0].square()

    def local_squared_norm(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the sum over its shards of each final
        host gradient's squared norm, divided by the shard's replica count (waits for the last ones)."""
        total = torch.zeros((), dtype=torch.float32)
        for shard in self.shards:
            if shard.squared_norm is not None:
                total += shard.squared_norm.result() / shard.replicas
        return total

    def _speculate(self, shard: ShardState, index: int) -> None:
        shard.wait_arrived()
        state = shard.pieces[index]
        torch._foreach_copy_(list(shard.spare_pieces[index]), list(state))
        shard.speculated[index] = True
        self._update(shard, [state], [shard.grad_pieces[index]])

    def _update(self, shard: ShardState, states: list[tuple[torch.Tensor, ...]], grads: list[torch.Tensor],
                grad_scale: torch.Tensor | None = None) -> None:
        """One fused AdamW call over pieces of `shard` (the kernel only reads the step count)."""
        masters, exp_avgs, exp_avg_sqs = (list(t) for t in zip(*states))
        torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], [shard.next_step] * len(grads),
                            lr=shard.lr, beta1=self.beta1, beta2=self.beta2, weight_decay=shard.weight_decay,
                            eps=self.eps, amsgrad=False, maximize=False, grad_scale=grad_scale)

    def settle_in_order(self, params: list[torch.Tensor]) -> None:
        """Settle shards in the order of `params` (the order the forward reads them); others after."""
        first = [self._by_param[id(p)] for p in params if id(p) in self._by_param]
        placed = {id(shard) for shard in first}
        self.shards = first + [shard for shard in self.shards if id(shard) not in placed]

    def finish(self, grad_norm: float, max_norm: float) -> bool:
        """Decide the step from the global norm and queue every shard's settling (see the module
        docstring); returns at once, True if speculative updates are being rolled back."""
        finite = math.isfinite(grad_norm)
        coefficient = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 and finite else 1.0
        speculated = False
        for shard in self.shards:
            if shard.grad is None:
                continue
            # A speculation not started yet is cancelled (its piece is updated directly); the
            # others have run or are running: their pieces are validated once they finish.
            started = [future for future in shard.pending if not future.cancel()]
            speculated = speculated or bool(started)
            shard.settled = self.pool.submit(self._settle, shard, started, finite, coefficient)
        rolled_back = speculated and finite and coefficient < 1.0
        self.rollbacks += int(rolled_back)
        self.last_clipped = finite and coefficient < 1.0
        return rolled_back

    def _settle(self, shard: ShardState, started: list[Future], finite: bool, coefficient: float) -> None:
        """Bring every piece of `shard` to the state the validated step defines; refresh its working weight."""
        for future in started:
            future.result()
        shard.wait_arrived()
        # The kernel divides the gradient by grad_scale as it reads it (and stores the quotient back:
        # the hand-over lent the buffer until now), which clips without a scaled copy.
        grad_scale = None if coefficient == 1.0 else torch.tensor(1.0 / coefficient)
        spares = shard.spare_pieces or [None] * len(shard.pieces)
        states, grads = [], []  # the pieces to update now, in one kernel call
        for state, spare, piece_grad, speculated in zip(shard.pieces, spares, shard.grad_pieces, shard.speculated):
            if speculated and (not finite or coefficient < 1.0):
                torch._foreach_copy_(list(state), list(spare))  # roll back
                speculated = False
            if not speculated and finite:
                states.append(state)
                grads.append(piece_grad)
        if grads:
            self._update(shard, states, grads, grad_scale)
        if finite:
            shard.step.copy_(shard.next_step)
        if shard.working is not shard.master:
            self._copy_to_working(shard)
        shard.grad, shard.arrived, shard.squared_norm = None, None, None
        shard.grad_pieces, shard.speculated, shard.pending = [], [], []

    def _copy_to_working(self, shard: ShardState) -> None:
        """The new master into the working weight; returns once the copy is complete."""
        device = shard.working.device
        if device.type == "cpu":  # a low-precision working weight on a CPU-only machine
            shard.working.copy_(shard.master)
            return
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.Stream(device)
        stream = self._copy_streams[device]
        with stream:  # a worker thread's current device may not be the shard's: name the stream
            shard.working.copy_(shard.master, non_blocking=True)
        stream.record_event().synchronize()

    def wait_for(self, params) -> None:
        """Block until the last step's update of `params` (and their working weights) is complete."""
        for param in params:
            shard = self._by_param.get(id(param))
            if shard is not None:
                shard.wait_settled()

    def synchronize(self) -> None:
        """Block until every shard's last update is complete."""
        for shard in self.shards:
            shard.wait_settled()

    def close(self) -> None:
        """End the worker threads (queued work is dropped, running work finishes): a process leaving
        on an error must not exit with a thread inside torch."""
        for pool in (self.arrivals, self.pool):
            pool.shutdown(wait=True, cancel_futures=True)

    def state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """`param`'s AdamW state, named as torch.optim.AdamW names it (local shard tensors, loadable in place)."""
        shard = self.shard_of(param)
        shard.wait_settled()
        return {"master": shard.master, "exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq, "step": shard.step}

    def working_from_masters(self) -> None:
        """After the masters were written (initialisation, a checkpoint): the working weights from them."""
        self.synchronize()
        for shard in self.shards:
            if shard.working is not shard.master:
                self._copy_to_working(shard)
