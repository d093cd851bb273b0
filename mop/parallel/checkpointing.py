"""Activation checkpointing per block, optionally with the saved block inputs kept in host memory.

"full": each block's forward runs under non-reentrant `torch.utils.checkpoint`: only the block's
inputs (the residual stream `[B, N, H]` and the small position/document tensors) stay alive until
the backward, which re-runs the block's forward (collectives included, in the same order on every
rank) and then its backward.

Offload: the checkpoint saves its inputs as autograd saved tensors, outside the region whose own
saved tensors the checkpoint discards; wrapping the checkpoint call in `save_on_cpu` therefore
moves exactly those inputs to host memory (pinned on CUDA) and brings each back when the backward
reaches its block. The device then holds one block's activations plus the residual stream of the
block being computed. On a CPU-only machine host and device are the same memory: the option runs
(and is tested for exactness) but cannot lower the process's footprint.

Applied before FSDP2 (`fully_shard` must wrap the checkpointed module). torch's wrapper strips its
prefix from `state_dict` keys, but `model.named_parameters()` shows it inside each block;
`canonical_name` removes it.
"""

from __future__ import annotations

from functools import partial

from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from mop.models.transformer import MoETransformer


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _offloaded_checkpoint(module, *args, pin_memory: bool, **kwargs):
    with save_on_cpu(pin_memory=pin_memory):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: MoETransformer, offload: bool, pin_memory: bool) -> None:
    """Checkpoint every block; with `offload`, keep the checkpointed inputs in host memory."""
    checkpoint_fn = partial(_offloaded_checkpoint, pin_memory=pin_memory) if offload else None
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn)
