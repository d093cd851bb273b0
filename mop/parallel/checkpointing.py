"""Activation checkpointing per block, optionally with the saved block inputs kept in host memory.

"full": each block's forward runs under non-reentrant `torch.utils.checkpoint`: only the block's
inputs (the residual stream `[B, N, H]`, the positions and the micro-batch's `Documents`) stay
alive until the backward, which re-runs the block's forward (collectives included, in the same
order on every rank) and then its backward.

Parts that recompute themselves. Head-chunked Ulysses attention (`parallel.attention_head_chunks
> 1`) and chunked LLEP (`parallel.llep_chunks > 1`) already recompute their internals chunk by
chunk in their own backward, saving only their inputs (and LLEP the experts it was shipped).
Re-running them in the block's recomputation too would make three runs. So they are
`KeepsForwardOutputs` parts: in the block's forward each keeps what its recomputation needs in
the call's `ForwardOutputs` (attention its output, which o_proj saves as its input; LLEP its
route), and in the block's recomputation returns it without exchanging or computing anything
(chunked LLEP returns a zero-stride placeholder, since only additions read it there, and ships its
helpers' expert weights again, which its backward needs). What runs, per block and micro-batch:

| options                    | attention exchange + kernel    | expert dispatch + GEMMs        | rest of block |
|----------------------------|--------------------------------|--------------------------------|---------------|
| no checkpointing, C = 1    | forward                        | forward                        | forward       |
| no checkpointing, C > 1    | forward, backward recompute    | forward, backward recompute    | forward       |
| checkpointing, C = 1       | forward, block recompute       | forward, block recompute       | both          |
| checkpointing, C > 1       | forward, backward recompute    | forward, backward recompute    | both          |

("both": forward, block recompute.)

(C: `attention_head_chunks` for the attention column, `llep_chunks` for the experts column; each
column follows its own option.) Nothing runs a third time. The price under checkpointing: besides
the block input, head-chunked attention's output stays alive until the backward (`[B, N, heads *
head_dim]`), offloaded with the input when offload is on. The LLEP count exchange is not repeated in
any block recomputation (the counts are kept), and only the forward records routing metrics.

Offload: the checkpoint saves its inputs as autograd saved tensors, outside the region whose own
saved tensors the checkpoint discards; running the checkpoint call under the `HostOffload` saved-
tensor hooks therefore moves exactly those inputs to host memory (pinned on CUDA) and brings each
back when the backward reaches its block. The kept outputs of the parts above go through the
same hooks. The device then holds one block's activations plus the residual stream being
computed. `HostOffload` is torch's `save_on_cpu` plus a count of the bytes
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
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from mop.config import Config, ConfigError
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


class ForwardOutputs:
    """The outputs that one checkpointed block call's self-recomputing parts produced in its forward,
    handed back to them in the block's recomputation (see the module docstring).

    `replaying` is False during the forward (parts `keep` their outputs) and True during the
    recomputation (parts `take` them instead of computing). Tensors are held through the block's
    offload hooks when it has them, like the block's own saved input.
    """

    def __init__(self, offload: HostOffload | None):
        self.replaying = False
        self._offload = offload
        self._kept: dict[int, object] = {}

    def keep(self, part: nn.Module, value) -> None:
        self._kept[id(part)] = tree_map(self._hold, value)

    def take(self, part: nn.Module):
        # Not popped: a backward that retains the graph recomputes the block again and needs it again.
        return tree_map(lambda leaf: self._release(leaf) if isinstance(leaf, _Held) else leaf, self._kept[id(part)])

    def _hold(self, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach()
        if self._offload is not None:
            return _Held(self._offload.pack_hook(leaf), None)
        return _Held(leaf, leaf._version)

    def _release(self, held: _Held) -> torch.Tensor:
        if self._offload is not None:
            return self._offload.unpack_hook(held.value)
        if held.value._version != held.version:
            raise RuntimeError("a chunked part's output kept for its block's recomputation was modified in place "
                               "after the forward; use out-of-place operations on it")
        return held.value


@dataclass
class _Held:
    value: object  # the kept tensor (which the forward's output shares), or the offload hooks' packed copy
    version: int | None  # the shared tensor's version when kept, to catch a later in-place change


def forward_autocast(device: torch.device):
    """The autocast state in effect now on `device`'s type, as a factory of a context to re-enter in a
    backward that recomputes part of this forward (autograd runs backward outside autocast)."""
    kind = device.type
    return partial(torch.autocast, kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind))


class KeepsForwardOutputs:
    """Mixin of a module that recomputes its own internals in its backward (head-chunked Ulysses,
    chunked LLEP): inside a checkpointed block it keeps its output from the forward and returns it in
    the block's recomputation instead of running a second time. `block_outputs` is set by the
    block's checkpoint around each call and is None outside one."""

    block_outputs: ForwardOutputs | None = None

    def kept_output(self):
        """This call's output from the block's forward, when this call is the block's recomputation."""
        outputs = self.block_outputs
        return outputs.take(self) if outputs is not None and outputs.replaying else None

    def keep_output(self, value) -> None:
        """Keep `value` for the block's recomputation, when this call is the block's forward."""
        outputs = self.block_outputs
        if outputs is not None and not outputs.replaying:
            outputs.keep(self, value)


def checkpoint_block(block: nn.Module, *args, offload: HostOffload | None, **kwargs):
    """Non-reentrant checkpoint of one block call, with a fresh `ForwardOutputs` for its parts: the
    first run of `run` is the forward, the second (in the backward) the recomputation."""
    if not torch.is_grad_enabled():  # nothing to save, nothing to recompute
        return block(*args, **kwargs)
    outputs = ForwardOutputs(offload)
    parts = [m for m in block.modules() if isinstance(m, KeepsForwardOutputs)]

    def run(*run_args, **run_kwargs):
        for part in parts:
            part.block_outputs = outputs
        try:
            return block(*run_args, **run_kwargs)
        finally:
            for part in parts:
                part.block_outputs = None
            outputs.replaying = True

    with offload if offload is not None else nullcontext():
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: MoETransformer, offload: bool, pin_memory: bool) -> HostOffload | None:
    """Checkpoint every block; with `offload`, keep the checkpointed inputs in host memory (returned store)."""
    store = HostOffload(pin_memory) if offload else None
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block, checkpoint_fn=partial(checkpoint_block, offload=store))
    model.activation_offload = store
    return store


def check_settings(config: Config, world: int) -> None:
    """Activation offload keeps the checkpointed block inputs: it needs block checkpointing."""
    t = config.train
    if t.offload_activations and t.activation_checkpointing == "none":
        raise ConfigError("train.offload_activations", "offloads the checkpointed block inputs; also set "
                          "--train.activation_checkpointing=full")
