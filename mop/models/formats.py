"""The published low-precision formats of a frozen base weight: how it is stored, dequantized and quantized.

A LoRA run (`mop.models.lora`) keeps the base weights it does not train in the precision they were
published in and dequantizes each one just for the GEMM that uses it (`mop.models.projections`).
The Hugging Face reader (`mop.models.hf_quantized`) decodes the same formats with these functions.
Each format is a `StoredFormat`: it knows its `lora.base_format` setting, the names and shapes of the
two tensors it stores a weight as (its data and its scales), and how it orients a stacked weight.

- `Fp8Blocks` (DeepSeek-V3, Kimi-K2): a weight `W [..., R, C]` (rows are output features) is
  stored as float8_e4m3fn beside fp32 `scale_inv [..., sum_p ceil(R_p / bo), ceil(C / bi)]`, and
  `W[r, c] = fp8[r, c] x scale_inv[block(r), c // bi]`. The rows come in parts `R_p` (a stacked
  `w_gate_up` is its experts' gate rows, then their up rows), each blocked from its own first
  row, as the checkpoints scale each published tensor; the last block of a part may be partial.
- `Mxfp4` (gpt-oss's experts): `P [E, a, b]` (applied as `x @ P_e`) is stored as `blocks [E, b, a / 32,
  16]` (uint8, two e2m1 codes a byte, the low nibble first) and `scales [E, b, a / 32]` (uint8
  exponents biased by 127): `P[e, 32 g + i, j] = e2m1(code i of group g of row j) x 2^(scales[e, j, g] - 127)`.

Dequantization computes in fp32 (as the reference dequantizes) and casts to the compute dtype, a
slab of at most `SLAB` elements of the leading (expert) dimension at a time, so its fp32 temporaries
stay bounded whatever the stack. Quantization (a full-precision base stored as fp8, a merged
checkpoint written back in its base's format): fp8 scales each block by its amax / 448; MXFP4
gives each group of 32 the smallest power of two that keeps it within e2m1's 6, codes rounded to
the nearest e2m1 value.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

FP8_MAX = 448.0
# e2m1 values by their 4-bit code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32
SLAB = 1 << 26  # elements dequantized at once along the leading dimension (fp32 temporaries of 256 MiB)
# MXFP4's bytes live in the model as float8_e4m3fn, bit for bit: FSDP2 (torch 2.11) makes each
# sharded tensor a Parameter that could require a gradient, which no integer dtype may; every copy
# between tensors of one dtype keeps the bits, and decoding views them back as uint8.
BYTE_CARRIER = torch.float8_e4m3fn


def _slabs(count: int, per_item: int):
    step = max(1, SLAB // max(1, per_item))
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


class StoredFormat(ABC):
    """A published low-precision format (module docstring): it stores a weight as two tensors, its
    data and its scales, named by `suffixes` of the weight's own name.

    A format quantizes a matrix `[..., R, C]`: the weight as the model holds it, or its transpose
    when the format fixes the orientation of stacked weights (`input_major`, `stores_transposed`).
    `parse` inverts `name`: `type(f).parse(f.name)` stores weights as `f` does (`same_as`).
    """

    suffixes: ClassVar[tuple[str, str]]
    """The names of its data and of its scales, as suffixes of the weight's name (Hugging Face's)."""
    input_major: ClassVar[bool] = False
    """Whether it stores every stacked weight as `[E, in, out]` (applied `x @ P_e`), whichever way the
    model holds it; otherwise it stores a weight as the model holds it."""

    @classmethod
    @abstractmethod
    def parse(cls, setting: str) -> StoredFormat | None:
        """The format a `lora.base_format` setting names, None when it names none of this kind."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Its `lora.base_format` setting."""

    @abstractmethod
    def for_linear(self) -> StoredFormat | None:
        """How a linear layer's weight is stored under this setting (None: in the compute dtype)."""

    @abstractmethod
    def for_experts(self, parts: tuple[int, ...]) -> StoredFormat:
        """How a routed experts' projection whose rows come in `parts` is stored under this setting."""

    @abstractmethod
    def same_as(self, other: StoredFormat | None) -> bool:
        """Whether `other` stores weights alike, so that one's stored tensors are the other's."""

    @abstractmethod
    def stored_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes of the data and of the scales that store a matrix of `shape`."""

    @abstractmethod
    def stored_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of the data and of the scales in the model."""

    @abstractmethod
    def published_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of the data and of the scales in a checkpoint."""

    @abstractmethod
    def dequantized_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the matrix stored as data of `data_shape` (`stored_shapes`' first, inverted)."""

    @abstractmethod
    def dequantize(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored matrix in `dtype`."""

    @abstractmethod
    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The data and the scales that store the matrix `values`."""

    def stores_transposed(self, transposed: bool) -> bool:
        """Whether a stacked weight the model holds `[E, in, out]` (`transposed`) or `[E, out, in]` is
        stored as its transpose."""
        return self.input_major and not transposed

    def reoriented(self, shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
        """`shape` with its last two sizes swapped when a weight held `transposed` is stored as its
        transpose: the model's shape of a weight <-> the shape of the matrix stored (its own inverse)."""
        if not self.stores_transposed(transposed):
            return tuple(shape)
        *lead, rows, columns = shape
        return (*lead, columns, rows)

    def weight_shape(self, data_shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
        """The model's shape of a weight held `transposed` (or not) that is stored as data of `data_shape`."""
        return self.reoriented(self.dequantized_shape(data_shape), transposed)


@dataclass(frozen=True)
class Fp8Blocks(StoredFormat):
    """fp8 e4m3 with fp32 block scales (module docstring); `parts`: the row parts of the last-but-one
    dimension (one part: the whole rows), `block`: (rows, columns) per scale. It stores every
    projection, each as the model holds it."""

    block: tuple[int, int] = (128, 128)
    parts: tuple[int, ...] = ()

    suffixes: ClassVar[tuple[str, str]] = ("", "_scale_inv")

    @classmethod
    def parse(cls, setting: str) -> Fp8Blocks | None:
        """`fp8` (blocks of 128x128) or `fp8:RxC`; raises ValueError for blocks without rows or columns."""
        match = re.fullmatch(r"fp8(?::(\d+)x(\d+))?", setting)
        if not match:
            return None
        rows, columns = (int(match[1]), int(match[2])) if match[1] else (128, 128)
        if rows < 1 or columns < 1:
            raise ValueError(f"{setting!r}: blocks need at least one row and one column")
        return cls((rows, columns))

    @property
    def name(self) -> str:
        return f"fp8:{self.block[0]}x{self.block[1]}"

    def for_linear(self) -> Fp8Blocks:
        return self

    def for_experts(self, parts: tuple[int, ...]) -> Fp8Blocks:
        """Blocked on each of the projection's row parts (as the checkpoints scale each published tensor)."""
        return Fp8Blocks(self.block, parts)

    def dequantized_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(data_shape)

    def stored_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes of the stored weight and of its scales, for a weight of `shape`."""
        *lead, rows, columns = shape
        return (tuple(shape), (*lead, self.scale_rows(rows), -(-columns // self.block[1])))

    def stored_dtypes(self) -> tuple[torch.dtype, ...]:
        return torch.float8_e4m3fn, torch.float32

    def published_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.stored_dtypes()

    def _parts(self, rows: int) -> tuple[int, ...]:
        return self.parts or (rows,)

    def scale_rows(self, rows: int) -> int:
        return sum(-(-part // self.block[0]) for part in self._parts(rows))

    def scale_offset(self, row: int, rows: int) -> int:
        """The first scale row of the part that starts at `row` (of `rows`): the blocks of the parts before."""
        offset = start = 0
        for part in self._parts(rows):
            if start >= row:
                break
            offset, start = offset + -(-part // self.block[0]), start + part
        return offset

    def same_as(self, other) -> bool:
        """Whether `other` stores weights alike (the same blocks; the row parts are the weight's own)."""
        return isinstance(other, Fp8Blocks) and other.block == self.block

    def row_blocks(self, rows: int, device) -> torch.Tensor:
        """Each row's scale row: its part's first scale row plus its block within the part."""
        out, first = [], 0
        for part in self._parts(rows):
            out.append(first + torch.arange(part, device=device) // self.block[0])
            first += -(-part // self.block[0])
        return torch.cat(out)

    def dequantize(self, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, columns = stored.shape[-2:]
        row_blocks = self.row_blocks(rows, stored.device)
        column_blocks = torch.arange(columns, device=stored.device) // self.block[1]
        if stored.dim() == 2:
            return (stored.float() * scale[row_blocks][:, column_blocks]).to(dtype)
        out = torch.empty(stored.shape, dtype=dtype, device=stored.device)
        for part in _slabs(stored.shape[0], rows * columns):
            out[part] = (stored[part].float() * scale[part][:, row_blocks][..., column_blocks]).to(dtype)
        return out

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`values [..., R, C]` (whole rows and columns) -> (fp8, fp32 scale_inv)."""
        *lead, rows, columns = values.shape
        bo, bi = self.block
        stored, scales = [], []
        start = 0
        for part in self._parts(rows):
            piece = values[..., start:start + part, :].float()
            start += part
            padded = torch.nn.functional.pad(piece, (0, -columns % bi, 0, -part % bo))
            blocks = padded.unflatten(-2, (-1, bo)).unflatten(-1, (-1, bi))  # [..., RB, bo, CB, bi]
            scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
            fp8 = (blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :part, :columns]
            stored.append(fp8.to(torch.float8_e4m3fn))
            scales.append(scale)
        return torch.cat(stored, dim=-2), torch.cat(scales, dim=-2)


@dataclass(frozen=True)
class Mxfp4(StoredFormat):
    """MXFP4 experts (module docstring): `P [E, a, b]` (`[E, in, out]`) as (blocks, scales). It stores
    the routed experts only; the other projections stay in the compute dtype."""

    suffixes: ClassVar[tuple[str, str]] = ("_blocks", "_scales")
    input_major: ClassVar[bool] = True

    @classmethod
    def parse(cls, setting: str) -> Mxfp4 | None:
        return cls() if setting == "mxfp4" else None

    @property
    def name(self) -> str:
        return "mxfp4"

    def for_linear(self) -> None:
        return None

    def for_experts(self, parts: tuple[int, ...]) -> Mxfp4:
        return self

    def same_as(self, other) -> bool:
        return isinstance(other, Mxfp4)

    def dequantized_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        experts, b, groups, width = data_shape  # two e2m1 codes a byte
        return experts, groups * 2 * width, b

    def stored_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        experts, a, b = shape
        return (experts, b, a // MX_GROUP, MX_GROUP // 2), (experts, b, a // MX_GROUP)

    def stored_dtypes(self) -> tuple[torch.dtype, ...]:
        return BYTE_CARRIER, BYTE_CARRIER

    def published_dtypes(self) -> tuple[torch.dtype, ...]:
        return torch.uint8, torch.uint8

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        experts, b, groups, _ = blocks.shape
        out = torch.empty((experts, groups * MX_GROUP, b), dtype=dtype, device=blocks.device)
        for part in _slabs(experts, b * groups * MX_GROUP):
            out[part] = decode_mxfp4(blocks[part], scales[part]).to(dtype)
        return out

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`values [E, a, b]` (a a multiple of 32) -> (blocks, scales)."""
        table = torch.tensor(E2M1, device=values.device)
        grouped = values.float().transpose(1, 2).unflatten(-1, (-1, MX_GROUP))  # [E, b, a / 32, 32]
        exponent = torch.ceil(torch.log2(grouped.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
        codes = ((grouped / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - table).abs().argmin(-1)
        blocks, scales = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)
        return blocks.view(BYTE_CARRIER), scales.view(BYTE_CARRIER)


FORMATS: tuple[type[StoredFormat], ...] = (Fp8Blocks, Mxfp4)
"""Every format a `lora.base_format` setting may name."""


def format_named(setting: str) -> StoredFormat | None:
    """The format `setting` names (a format's `name`, or "fp8" for its default blocks), None when no
    format does; raises ValueError for a format's setting with impossible parameters."""
    for kind in FORMATS:
        fmt = kind.parse(setting)
        if fmt is not None:
            return fmt
    return None


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks [..., b, a / 32, 16]`, `scales [..., b, a / 32]` -> fp32 `[..., a, b]`."""
    table = torch.tensor(E2M1, device=blocks.device)
    blocks, scales = blocks.view(torch.uint8), scales.view(torch.uint8)  # published, or carried (BYTE_CARRIER)
    exponents = scales.to(torch.int32) - 127
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())  # [..., b, a / 32, 32]
    return values.flatten(-2).transpose(-1, -2)


def decode_fp8(stored: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], first_row: int) -> torch.Tensor:
    """fp32 rows of one published fp8 tensor: `stored [n, C]` are its rows from `first_row` on, `scale`
    the scale rows from `first_row // block[0]` on."""
    rows_per, columns_per = block
    offset = first_row - first_row // rows_per * rows_per
    row_blocks = (offset + torch.arange(stored.shape[0], device=stored.device)) // rows_per
    column_blocks = torch.arange(stored.shape[1], device=stored.device) // columns_per
    return stored.float() * scale.float()[row_blocks][:, column_blocks]
