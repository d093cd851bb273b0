"""Collectives as autograd functions, shared by the parallel techniques.

- `all_to_all(x, out_splits, in_splits, group)`: rows of `x` (dim 0) are cut into consecutive
  pieces of `in_splits[j]` rows for rank j of `group`; the result stacks the `out_splits[j]` rows
  received from rank j in rank order. Backward is the inverse exchange (splits swapped).
- `all_reduce_sum(x, group)`: forward sums over the group; since every rank's output is that sum,
  the gradient of rank r's input is the sum of all ranks' output gradients (the same all-reduce).
- `all_gather_rows(x, group)`: no-grad gather of per-rank `[n, ...]` tensors into `[W*n, ...]`
  (integer metadata such as document ids).

Invariant: each function issues the same collectives in the same order on every rank of
`group`, in forward and in backward, so a rank whose input is empty still participates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def wait_for(works) -> None:
    """Wait for asynchronous collectives, in a profiler scope named as one (`mop.profiling` counts the
    wait as communication, not as the computation around it)."""
    with record_function("c10d::wait"):
        for work in works:
            work.wait()


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)


# torch 2.13 renames all_gather_into_tensor (and warns on the old name); older releases lack the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.no_grad()
def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out
