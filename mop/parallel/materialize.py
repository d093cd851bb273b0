"""Allocate and initialise a model that was built and parallelised on the meta device: every rank
its own shards, never the full model.

Algorithm. The model is constructed under `torch.device("meta")` (no memory), in its storage
dtype, and parallelised there: Ulysses, expert partitioning, the vocabulary row shard,
activation checkpointing and FSDP2 only slice, swap, wrap and shard meta tensors. `to_empty`
then allocates each rank's local tensors on its device, and each local tensor is filled with
the initial values of the global rows it holds (`initial_rows`, keyed by seed, name and
position; the rows come from `GlobalViews.first_row`), a chunk of about INIT_BLOCK elements at a
time: the largest temporary is one fp32 chunk. Padding rows (the vocabulary shard's last rows
past V) are zero. The host optimizer's fp32 masters are written the same way, from the same
fp32 values, so a bf16 working weight is exactly the master rounded to bf16. A Hugging Face
import is read the same way, rows from safetensors slices (`mop.checkpoint`).

Invariant: whatever the layout (the single-process reference included), the global tensor
assembled from every rank's shards equals `build_model`'s, bit for bit. No communication.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from mop.models.transformer import INIT_BLOCK, MoETransformer, initial_rows
from mop.parallel.mesh import DistLayout
from mop.parallel.views import GlobalViews

RowSource = Callable[[str, torch.Size, int, int], torch.Tensor]


def materialize(model: MoETransformer, layout: DistLayout | None, device: torch.device,
                rows: RowSource | None) -> GlobalViews:
    """Allocate `model`'s local tensors on `device` and write their rows from `rows` (see the module
    docstring: the initial values, `initial_values`); returns the model's global views. `rows=None`
    only zeroes the padding rows: the caller writes the real rows (the host optimizer's masters,
    then copied to the weights)."""
    model.to_empty(device=device)
    model.tie_weights()  # `to_empty` replaces plain parameters one module at a time
    model.reset_buffers()
    views = GlobalViews(model, layout)
    with torch.no_grad():
        for param in model.parameters():
            padding = param.to_local() if hasattr(param, "to_local") else param
            padding[views.local(param).shape[0]:].zero_()
    if rows is not None:
        write_weights(model, views, rows)
    return views


def initial_values(seed: int, std: float) -> RowSource:
    """The initial rows of every parameter (`initial_rows`), the same under any layout."""
    return partial(initial_rows, seed=seed, std=std)


def write_weights(model: MoETransformer, views: GlobalViews, rows: RowSource, optimizer=None) -> None:
    """Every parameter's local rows from `rows`: into the optimizer's masters (`mop.optim.optimizer`;
    the host optimizer's fp32 masters, then copied to the working weights: a bf16 working weight is
    its master rounded), else into the parameters themselves."""
    for param in model.parameters():
        master = optimizer.master(param) if optimizer is not None else None
        write_rows(param, views.local(param, master), views, rows)
    if optimizer is not None:
        optimizer.weights_written()


@torch.no_grad()
def write_rows(param: torch.Tensor, target: torch.Tensor, views: GlobalViews, rows: RowSource) -> None:
    """Fill `target` (the real rows of `param`'s local shard, or a tensor shaped like them: a host
    master) from `rows(name, global shape, first row, count)`, a chunk of rows at a time: the
    initial values (`initial_rows`) or a checkpoint's (`mop.models.hf.HFWeights.rows`)."""
    if target.shape[0] == 0:
        return
    name, shape, first = views.names[id(param)], views.global_shape(param), views.first_row(param)
    rows_per_chunk = max(1, INIT_BLOCK // max(1, target[0].numel()))
    for start in range(0, target.shape[0], rows_per_chunk):
        count = min(rows_per_chunk, target.shape[0] - start)
        target[start:start + count].copy_(rows(name, shape, first + start, count))
