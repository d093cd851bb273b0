"""Feeding `HostAdamW` while the backward runs: which gradients are final, and when.

A block's gradients are final once the backward has left the block: its FSDP2 post-backward
(reduce-scatter into the sharded `.grad`, including the expert units nested in it) runs when the
gradient of the block's input is formed, which is before the backward reaches the block below.
So a backward pre-hook on block i-1 hands block i's FSDP2-sharded parameters to the optimizer;
block 0, the embedding, the final norm, the output head, and every parameter FSDP2 does not
manage (their `.grad` may still be accumulating from several uses) are handed over when
`loss.backward()` returns.
Only the last micro-batch of a step is armed: earlier ones only accumulate.

Early hand-over is CPU-only today: on CUDA, FSDP2 writes the sharded gradients on its
reduce-scatter stream, and reading them early needs a wait on that stream's event and a copy on a
side stream, which is not written yet. CUDA runs therefore hand everything over at `flush`, after
the backward (exact, not overlapped).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from mop.optim.host_adamw import HostAdamW


class GradientFeed:
    """Delivers each parameter's final gradient to `optimizer` exactly once per step."""

    def __init__(self, model: torch.nn.Module, optimizer: HostAdamW):
        self.optimizer = optimizer
        self.armed = False
        self.delivered: set[int] = set()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.early = all(p.device.type == "cpu" for p in self.params)
        layers = list(model.layers)
        for below, block in zip(layers[:-1], layers[1:]):
            below.register_full_backward_pre_hook(self._hook_for(block))

    def _hook_for(self, block: torch.nn.Module):
        def hook(module, grad_output):
            if self.armed and self.early:
                # Only FSDP2's sharded gradients are assigned whole, in its post-backward.
                self._deliver(p for p in block.parameters() if isinstance(p, DTensor))

        return hook

    def _deliver(self, params) -> None:
        for param in params:
            if id(param) not in self.delivered and param.grad is not None:
                self.delivered.add(id(param))
                self.optimizer.gradient_ready(param, param.grad)

    def arm(self) -> None:
        """The next backward is the step's last: deliver gradients as they become final."""
        self.armed = True

    def flush(self) -> None:
        """After the last backward: deliver everything not handed over yet, and disarm."""
        self._deliver(self.params)
        self.armed = False
        self.delivered.clear()
