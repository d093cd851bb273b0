"""Feeding `HostAdamW` while the backward runs, and waiting for its updates in the next forward.

Hand-over. FSDP2 assigns a sharded parameter's gradient in its post-backward, right after the
unit's reduce-scatter (with the LLEP helpers' foreign-weight gradients already added into the
expert partitions), and then calls the parameter's post-accumulate-grad hooks, on the stream that
produced the gradient. A hook on every FSDP2-managed parameter hands that micro-batch's gradient
to the optimizer there and releases it (`param.grad = None`), while the backward goes on below:
the optimizer accumulates micro-batches in fp32 host memory, so the device never holds more than
the gradients in flight between a reduce-scatter and its copy, and never accumulates in bf16.
On CUDA the hook runs under FSDP2's post-reduce stream, so the optimizer's device-to-host copy is
queued behind the reduce-scatter without a wait on the compute stream (see
`HostAdamW.gradient_ready`). Autograd itself never accumulates into FSDP2's sharded parameters
(the graph uses the unsharded ones), so only FSDP2 fires these hooks. Every parameter FSDP2 does
not manage (its `.grad` may still be accumulating from several uses) is handed over, and
released, when the micro-batch's `loss.backward()` returns (`flush`). The last micro-batch of a
step is marked (`arm(last=True)`): its hand-over makes each gradient final.

Waiting. `HostAdamW.finish` returns before the updates are done; they are settled on the worker
thread in the forward's order: the parameters outside the blocks (embedding, final norm, output
head) first, then block by block. The next forward waits only for what it is about to read: a
forward pre-hook on every block, prepended so that it runs before FSDP2's own (which gathers the
block's shards), waits for that block's parameters, and `before_forward` waits for the rest
before the step's first forward. So block k's update runs while blocks < k compute.
`take_wait_s` reports the time the forward spent waiting: the optimizer time the step could not hide.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch.distributed.tensor import DTensor

from mop.optim.host_adamw import HostAdamW


class GradientFeed:
    """Delivers each parameter's final gradient to `optimizer` exactly once per step, and holds the
    next forward back only where it would read a parameter whose update is not finished."""

    def __init__(self, model: torch.nn.Module, optimizer: HostAdamW):
        self.optimizer = optimizer
        self.armed = False
        self.last = False
        self.delivered: set[int] = set()
        self.early = 0  # parameters delivered from inside the step's last backward (a metric)
        self._wait_s = 0.0  # time forwards spent waiting for updates since `take_wait_s`
        self.params = [p for p in model.parameters() if p.requires_grad]
        for param in self.params:
            if isinstance(param, DTensor):  # FSDP2-sharded: final when FSDP2 assigns it
                param.register_post_accumulate_grad_hook(self._hook)
        in_blocks = [[p for p in block.parameters() if p.requires_grad] for block in model.layers]
        block_ids = {id(p) for params in in_blocks for p in params}
        self.outer = [p for p in self.params if id(p) not in block_ids]
        optimizer.settle_in_order(self.outer + [p for params in in_blocks for p in params])
        for block, params in zip(model.layers, in_blocks):
            block.register_forward_pre_hook(partial(self._wait_before_block, params), prepend=True)

    def _hook(self, param: torch.Tensor) -> None:
        if self.armed:
            delivered = self._deliver([param])
            if self.last:
                self.early += delivered

    def _deliver(self, params) -> int:
        count = 0
        for param in params:
            if id(param) not in self.delivered and param.grad is not None:
                self.delivered.add(id(param))
                self.optimizer.gradient_ready(param, param.grad, self.last)
                param.grad = None
                count += 1
        return count

    def _wait(self, params) -> None:
        start = time.perf_counter()
        self.optimizer.wait_for(params)
        self._wait_s += time.perf_counter() - start

    def take_wait_s(self) -> float:
        """Seconds forwards waited for updates since the last call (the optimizer time not hidden)."""
        waited, self._wait_s = self._wait_s, 0.0
        return waited

    def _wait_before_block(self, params, _module, _args) -> None:
        self._wait(params)

    def before_forward(self) -> None:
        """Before a step's first forward: wait for the parameters outside the blocks."""
        self._wait(self.outer)

    def arm(self, last: bool) -> None:
        """Before a micro-batch's backward: deliver gradients as they are reduced; `last`: the
        step's last micro-batch (its hand-over makes each gradient final)."""
        self.armed, self.last = True, last
        if last:
            self.early = 0

    def flush(self) -> None:
        """After a micro-batch's backward: deliver everything not handed over yet, and disarm."""
        self._deliver(self.params)
        if self.last:
            self.optimizer.gradients_final()
        self.armed = False
        self.delivered.clear()
