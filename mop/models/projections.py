"""Stacked expert projections, as an experts module's computation applies them to rows sorted by expert.

Expert e's rows are the contiguous run of `counts[e]` rows; every projection of the computation
maps each run with its expert's matrix, as one grouped GEMM (`torch._grouped_mm`) where it applies
or one GEMM per expert (the two give identical results). `Groups` holds that choice for one
computation, and the zero rows the CUDA grouped GEMM pads each group with (its weight-gradient
kernel needs group offsets aligned to 16 bytes); padding rows stay zero through every projection.

A `Projection` takes rows of width `in_features` to `out_features`:
- `Dense(weight)`: `x W_e^T` for a stacked `[E, out, in]` tensor (`x W_e` for `[E, in, out]`:
  `transposed`, gpt-oss's orientation); trained or frozen (a frozen one saves nothing for the
  backward but itself: autograd keeps the rows only for a weight that needs their gradient);
- `Dequantized(fmt, stored)`: a frozen weight kept in a published format (`mop.models.formats`),
  dequantized for the forward's GEMM and again for the backward's, so that only the stored bytes
  (the expert-parallel unit's gathered parameters) outlive the forward, never a widened copy;
- `Adapted(base, a, b, scaling)`: LoRA, `base(x) + scaling (x A_e^T) B_e^T` with `A [E, r, in]`,
  `B [E, out, r]` (cast to the rows' dtype, as autocast casts a linear layer's weight).
`back(probe)` is the transposed product `probe W_e` (`[rows, out] -> [rows, in]`): the chunked
expert-parallel backward's probe (`mop.models.moe.swiglu_experts`) runs the down projection that way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows per expert group on CUDA: 16 bytes of bf16 rows (and of fp32 ones), whatever dtype
# autocast computes the grouped GEMM in.
CUDA_GROUP_ROWS = 8
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def device_ints(values: list[int], device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host-built integer tensor on `device`, without waiting for the device.

    `torch.tensor(values, device=cuda)` copies with `non_blocking=False`, which synchronises the
    stream: every kernel queued before it must finish. A non-blocking copy from pageable memory
    is staged by CUDA before it returns, so `values` may go away at once."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def row_ranges(starts: list[int], lengths: list[int], device) -> torch.Tensor:
    """`cat([arange(s, s + n) for s, n in zip(starts, lengths)])`, expanded on `device` from the
    per-range integers (no per-row host work, no wait for the device)."""
    total = sum(lengths)
    start, length = device_ints(starts, device), device_ints(lengths, device)
    shift = torch.repeat_interleave(start - (length.cumsum(0) - length), length, output_size=total)
    return shift + torch.arange(total, device=device)


class Projection:
    """See the module docstring."""

    in_features: int
    out_features: int

    def grouped_applies(self, dtype: torch.dtype) -> bool:
        """Whether `torch._grouped_mm` takes this projection on rows of `dtype`: its weights in that
        dtype, every width a multiple of 16 bytes."""
        align = 16 // dtype.itemsize
        return all(width % align == 0 for width in self.widths())

    def widths(self) -> tuple[int, ...]:
        return self.in_features, self.out_features

    def __call__(self, rows: torch.Tensor, groups: "Groups") -> torch.Tensor:
        raise NotImplementedError

    def back(self, probe: torch.Tensor, groups: "Groups") -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Groups:
    """How one computation maps rows sorted by expert (module docstring)."""

    counts: list[int]
    grouped: bool
    padded: list[int]
    offsets: torch.Tensor | None  # cumulative padded counts, int32 on the device (grouped only)
    where: torch.Tensor | None  # each real row's position among the padded ones (None: no padding)

    @classmethod
    def of(cls, rows: torch.Tensor, counts: list[int], projections, grouped: bool | None = None,
           align: int | None = None) -> "Groups":
        """Grouped GEMMs where every projection takes them (`grouped=None`), padded to multiples of
        `align` rows (None: CUDA_GROUP_ROWS on CUDA, none on the CPU)."""
        if grouped is None:
            grouped = rows.dtype in GROUPED_DTYPES and all(p.grouped_applies(rows.dtype) for p in projections)
        if not grouped:
            return cls(counts, False, counts, None, None)
        align = align or (CUDA_GROUP_ROWS if rows.is_cuda else 1)
        padded = [-(-count // align) * align for count in counts]
        where = None if align == 1 else row_ranges([sum(padded[:e]) for e in range(len(padded))], counts, rows.device)
        return cls(counts, True, padded, device_ints(padded, rows.device).cumsum(0).to(torch.int32), where)

    def pad(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Rows (or per-row values) placed among the zero padding rows."""
        if t is None or self.where is None:
            return t
        return t.new_zeros((sum(self.padded), *t.shape[1:])).index_copy(0, self.where, t)

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.where is None else t[self.where]

    def per_expert(self, rows: torch.Tensor, weights, apply) -> torch.Tensor:
        """`apply(rows of expert e, weights[e])` over the experts with rows, concatenated. With no rows
        at all, an empty product still keeps the output on the autograd graph."""
        outputs = [apply(part, weight) for part, weight in zip(rows.split(self.counts), weights) if part.shape[0]]
        return torch.cat(outputs) if outputs else apply(rows, weights[0])


@dataclass
class Dense(Projection):
    weight: torch.Tensor
    transposed: bool = False

    def __post_init__(self):
        dims = self.weight.shape[1:]
        self.in_features, self.out_features = dims if self.transposed else reversed(dims)

    def grouped_applies(self, dtype: torch.dtype) -> bool:
        return self.weight.dtype == dtype and super().grouped_applies(dtype)

    def _in_out(self) -> torch.Tensor:
        return self.weight if self.transposed else self.weight.transpose(1, 2)

    def __call__(self, rows, groups):
        if groups.grouped:
            return torch._grouped_mm(rows, self._in_out(), offs=groups.offsets)
        # unbind once: its backward stacks the per-expert gradients in one tensor, where indexing
        # w[expert] per expert would allocate a full-size zero gradient for every expert.
        apply = torch.matmul if self.transposed else F.linear
        return groups.per_expert(rows, self.weight.unbind(0), apply)

    def back(self, probe, groups):
        if groups.grouped:
            return torch._grouped_mm(probe, self._in_out().transpose(1, 2), offs=groups.offsets)
        return groups.per_expert(probe, self.weight.unbind(0),
                                 (lambda p, w: p @ w.T) if self.transposed else torch.matmul)


@dataclass
class Dequantized(Projection):
    """A frozen stacked weight stored in `fmt` as the tensors `stored` (module docstring)."""

    fmt: object  # a `mop.models.formats` format
    stored: tuple[torch.Tensor, ...]
    transposed: bool = False
    in_features: int = 0
    out_features: int = 0

    def dense(self, dtype: torch.dtype) -> Dense:
        return Dense(self.fmt.dequantize(*self.stored, dtype), self.transposed)

    def __call__(self, rows, groups):
        return _FrozenProjection.apply(rows, self, groups)

    def back(self, probe, groups):
        with torch.no_grad():
            return self.dense(probe.dtype).back(probe, groups)


class _FrozenProjection(torch.autograd.Function):
    """A `Dequantized` projection: the weight dequantized in the forward and again in the backward;
    the stored tensors (parameters) are all it keeps."""

    @staticmethod
    def forward(ctx, rows, projection: Dequantized, groups: Groups):
        ctx.projection, ctx.groups = projection, groups
        return projection.dense(rows.dtype)(rows, groups)

    @staticmethod
    def backward(ctx, grad):
        return ctx.projection.dense(grad.dtype).back(grad, ctx.groups), None, None


@dataclass
class Adapted(Projection):
    base: Projection
    lora_a: torch.Tensor  # [E, r, in]
    lora_b: torch.Tensor  # [E, out, r]
    scaling: float

    def __post_init__(self):
        self.in_features, self.out_features = self.base.in_features, self.base.out_features

    def widths(self) -> tuple[int, ...]:
        return (*self.base.widths(), self.lora_a.shape[1])

    def grouped_applies(self, dtype: torch.dtype) -> bool:
        return self.base.grouped_applies(dtype) and super().grouped_applies(dtype)

    def _factors(self, dtype: torch.dtype) -> tuple[Dense, Dense]:
        return Dense(self.lora_a.to(dtype)), Dense(self.lora_b.to(dtype))

    def __call__(self, rows, groups):
        a, b = self._factors(rows.dtype)
        return self.base(rows, groups) + b(a(rows, groups), groups) * self.scaling

    def back(self, probe, groups):
        a, b = self._factors(probe.dtype)
        return self.base.back(probe, groups) + a.back(b.back(probe, groups) * self.scaling, groups)
