"""Quantized Hugging Face checkpoints, dequantized block by block as they are read.

A checkpoint's `quantization_config` picks how its tensors are read (`reader_for`):
- none: every tensor as stored;
- FP8 with block scales (DeepSeek-V3, Kimi-K2: `{quant_method: "fp8", fmt: "e4m3",
  weight_block_size: [bo, bi]}`): a quantized weight `W [out, in]` is stored as `float8_e4m3fn`
  beside `W_scale_inv [ceil(out / bo), ceil(in / bi)]` (fp32), and
  `W[i, j] = fp8[i, j] x scale_inv[i // bo, j // bi]`; the weights that are not quantized (the
  embedding, the head, norms, routers) have no scale tensor;
- MXFP4 (gpt-oss: `{quant_method: "mxfp4"}`): an expert tensor `P` (`[E, a, b]` in the model) is
  stored as `P_blocks [E, b, a / 32, 16]` (uint8, two e2m1 values a byte, the low nibble first) and
  `P_scales [E, b, a / 32]` (uint8 exponents biased by 127): `P^T[e, j, 32 g + i] = e2m1(nibble i of
  block g) x 2^(scale[e, j, g] - 127)`, the layout OpenAI publishes and transformers dequantizes.

Each reader takes its companion tensors out of the checkpoint's tensor list (so the loader's "every
tensor used" rule sees them as part of their weight), gives each weight's shape as the model sees
it, and reads rows `[first, first + count)` of it: only those rows' stored data and scales are read
(the files are memory-mapped), so a rank that materialises its shard dequantizes only that shard,
in fp32, to be cast to the training dtype.
"""

from __future__ import annotations

import torch

from mop.models import formats
from mop.models.formats import decode_fp8, decode_mxfp4
from mop.models.hf_mapping import HFConversionError

SUPPORTED = "fp8 e4m3 block-scaled (DeepSeek-V3, Kimi-K2), mxfp4 (gpt-oss) and unquantized checkpoints"


class Unquantized:
    """Tensors read as stored."""

    format = None
    """The format its quantized weights are published in (`mop.models.formats`; None: none)."""

    def split(self, tensors: dict, path) -> None:
        """Take the companion tensors out of `tensors` (key -> (handle, file)); none here."""

    def shape(self, tensors: dict, key: str) -> list[int]:
        return list(tensors[key][0].get_slice(key).get_shape())

    def check(self, key: str, shape: list[int], file) -> None:
        """Raise when a weight's companions do not fit its shape; nothing to check here."""

    def rows(self, handle, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        """Rows `[first, first + count)` of tensor `key` (all when `first` is None), in fp32."""
        return self.raw_rows(handle, key, first, count).float()

    def raw_rows(self, handle, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        """Rows of tensor `key` as stored."""
        part = handle.get_slice(key)
        return part[:] if first is None else part[first:first + count]

    def published_rows(self, handle, key: str, companion: int, rows: slice = slice(None)) -> torch.Tensor | None:
        """None: no weight is published quantized (`_Companions.published_rows`)."""
        return None


def reader_for(quantization: dict | None, config_file) -> Unquantized:
    """The reader of a config.json's `quantization_config` (None: unquantized)."""
    if not quantization:
        return Unquantized()
    method = quantization.get("quant_method")
    if method == "fp8" and quantization.get("fmt", "e4m3") == "e4m3":
        block = quantization.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise HFConversionError(f"{config_file}: quantization_config weight_block_size={block!r}; mop reads fp8 "
                                    "with [rows, columns] block scales only")
        return Fp8BlockScales((block[0], block[1]))
    if method == "mxfp4":
        return Mxfp4()
    kind = f"quant_method={method!r}" + (f" fmt={quantization.get('fmt')!r}" if method == "fp8" else "")
    raise HFConversionError(f"{config_file}: quantization_config {kind} is not supported; mop reads {SUPPORTED}")


class _Companions(Unquantized):
    """A reader whose quantized weights carry companion tensors named by suffixes of theirs (their
    format's `suffixes`: the data's, then the scales')."""

    stored: str  # the suffix of the stored data ("" when the weight keeps its own name)
    companion: str  # the suffix of the scales

    def split(self, tensors: dict, path) -> None:
        self.companions: dict[str, tuple] = {}  # weight key -> (stored key, scale key, scale handle)
        for key in [key for key in tensors if key.endswith(self.companion)]:
            weight = key[: -len(self.companion)]
            if weight + self.stored not in tensors:
                raise HFConversionError(f"{path}: {key} scales no tensor ({weight + self.stored} is missing); the "
                                        "checkpoint is incomplete")
            self.companions[weight] = (weight + self.stored, key, tensors.pop(key)[0])
            if self.stored:  # the weight is known by its model name from now on
                tensors[weight] = tensors.pop(weight + self.stored)

    def published_rows(self, handle, key: str, companion: int, rows: slice = slice(None)) -> torch.Tensor | None:
        """Rows of weight `key`'s stored data (`companion` 0) or scales (1) as published, without
        dequantizing them; None for a weight published unquantized."""
        if key not in self.companions:
            return None
        stored_key, scale_key, scale_handle = self.companions[key]
        return (handle.get_slice(stored_key) if companion == 0 else scale_handle.get_slice(scale_key))[rows]


class Fp8BlockScales(_Companions):
    stored, companion = formats.Fp8Blocks.suffixes

    def __init__(self, block: tuple[int, int]):
        self.block = block
        self.format = formats.Fp8Blocks(block)

    def check(self, key: str, shape: list[int], file) -> None:
        if key not in self.companions:
            return
        _, scale_key, handle = self.companions[key]
        want = [-(-size // block) for size, block in zip(shape, self.block)]
        got = list(handle.get_slice(scale_key).get_shape())
        if got != want:
            raise HFConversionError(f"{file}: {scale_key} has shape {got} but {key} {shape} in blocks of "
                                    f"{list(self.block)} needs {want}; the checkpoint is damaged")

    def rows(self, handle, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        if key not in self.companions:
            return super().rows(handle, key, first, count)
        stored, (_, scale_key, scale_handle) = self.raw_rows(handle, key, first, count), self.companions[key]
        first = first or 0
        rows_per = self.block[0]
        scale = scale_handle.get_slice(scale_key)[first // rows_per:-(-(first + stored.shape[0]) // rows_per)]
        return decode_fp8(stored, scale, self.block, first)


class Mxfp4(_Companions):
    stored, companion = formats.Mxfp4.suffixes
    format = formats.Mxfp4()

    def shape(self, tensors: dict, key: str) -> list[int]:
        if key not in self.companions:
            return super().shape(tensors, key)
        experts, columns, groups, width = tensors[key][0].get_slice(self.companions[key][0]).get_shape()
        return [experts, groups * 2 * width, columns]

    def rows(self, handle, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        if key not in self.companions:
            return super().rows(handle, key, first, count)
        stored, scale_key, scale_handle = self.companions[key]
        rows = slice(None) if first is None else slice(first, first + count)
        return decode_mxfp4(handle.get_slice(stored)[rows], scale_handle.get_slice(scale_key)[rows])  # [e, a, b]
