"""Activation checkpointing per block, optionally with the saved block inputs kept in host memory.

"full": each block's forward runs under non-reentrant `torch.utils.checkpoint`: only the block's
inputs (the residual stream `[B, N, H]` and the small position/document tensors) stay alive until
the backward, which re-runs the block's forward (collectives included, in the same order on every
rank) and then its backward.

Offload: the checkpoint saves its inputs as autograd saved tensors, outside the region whose own
saved tensors the checkpoint discards; running the checkpoint call under the `HostOffload` saved-
tensor hooks therefore moves exactly those inputs to host memory (pinned on CUDA) and brings each
back when the backward reaches its block. The device then holds one block's activations plus the
residual stream being computed. `HostOffload` is torch's `save_on_cpu` plus a count of the bytes
it holds, which the memory benchmarks and metrics report (on a CPU-only machine host and device
are the same memory: the option runs and is exact, and the count is how its effect is shown).
A checkpointed model keeps its store as `model.activation_offload` (None without offload), so
code that only sees the parallelized model can still read the count.

Applied before FSDP2 (`fully_shard` must wrap the checkpointed module). torch's wrapper strips its
prefix from `state_dict` keys, but `model.named_parameters()` shows it inside each block;
`canonical_name` removes it.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from mop.models.transformer import MoETransformer


class HostOffload(saved_tensors_hooks):
    """Saved-tensor hooks that keep saved tensors in host memory; `live_bytes` is what they hold now."""

    def __init__(self, pin_memory: bool):
        self.live_bytes = 0
        self.peak_bytes = 0

        def pack(tensor: torch.Tensor):
            # Counted before the copy exists, so a tracker never sees host bytes as device bytes.
            self._account(tensor.numel() * tensor.element_size())
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor)
            weakref.finalize(host.untyped_storage(), self._release, host.untyped_storage().nbytes())
            return tensor.device, host

        def unpack(packed):
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (the trainer calls it at each step)."""
        self.peak_bytes = self.live_bytes

    def _account(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _offloaded_checkpoint(module, *args, offload: HostOffload, **kwargs):
    with offload:
        return checkpoint(module, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: MoETransformer, offload: bool, pin_memory: bool) -> HostOffload | None:
    """Checkpoint every block; with `offload`, keep the checkpointed inputs in host memory (returned store)."""
    store = HostOffload(pin_memory) if offload else None
    checkpoint_fn = partial(_offloaded_checkpoint, offload=store) if offload else None
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn)
    model.activation_offload = store
    return store
