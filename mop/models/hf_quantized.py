"""Quantized Hugging Face checkpoints, dequantized row block by row block as they are read.

FP8 with block scales (DeepSeek-V3, Kimi-K2: `quantization_config = {quant_method: "fp8", fmt:
"e4m3", weight_block_size: [bo, bi]}`): a quantized weight `W [out, in]` is stored as
`float8_e4m3fn` beside `W_scale_inv [ceil(out / bo), ceil(in / bi)]` (fp32), and
`W[i, j] = fp8[i, j] x scale_inv[i // bo, j // bi]`. The weights that are not quantized (the
embedding, the head, norms, routers) have no scale tensor and are read as they are.

`Fp8BlockScales.split` takes the scale tensors out of a checkpoint's tensor list (so that the
loader's "every tensor used" rule sees each scale as part of its weight), and `rows` reads and
dequantizes rows `[first, first + count)` of a weight: only the fp8 rows and the scale rows
covering them are read (the files are memory-mapped), so a rank that materialises its shard
dequantizes only that shard, in fp32, to be cast to the training dtype.
"""

from __future__ import annotations

import torch

from mop.models.hf_mapping import HFConversionError

SCALE_SUFFIX = "_scale_inv"


class Fp8BlockScales:
    def __init__(self, block: tuple[int, int], scale_of: dict[str, str]):
        self.block = block
        self.scale_of = scale_of
        """Weight key -> its scale tensor's key."""

    @staticmethod
    def from_config(quantization: dict | None, config_file) -> "Fp8BlockScales | None":
        """The scales a config.json's `quantization_config` says the weights carry (None: unquantized)."""
        if not quantization:
            return None
        method = quantization.get("quant_method")
        if method != "fp8" or quantization.get("fmt", "e4m3") != "e4m3":
            kind = f"quant_method={method!r}" + (f" fmt={quantization.get('fmt')!r}" if method == "fp8" else "")
            raise HFConversionError(f"{config_file}: quantization_config {kind} is not supported; mop reads fp8 e4m3 "
                                    "block-scaled checkpoints (DeepSeek-V3, Kimi-K2) and unquantized ones")
        block = quantization.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise HFConversionError(f"{config_file}: quantization_config weight_block_size={block!r}; mop reads fp8 "
                                    "with [rows, columns] block scales only")
        return Fp8BlockScales((block[0], block[1]), {})

    def split(self, tensors: dict, path) -> None:
        """Move each `<weight>_scale_inv` out of `tensors` into `scale_of` (its weight must be there)."""
        for key in [key for key in tensors if key.endswith(SCALE_SUFFIX)]:
            weight = key[: -len(SCALE_SUFFIX)]
            if weight not in tensors:
                raise HFConversionError(f"{path}: {key} scales no tensor ({weight} is missing); the checkpoint is "
                                        "incomplete")
            self.scale_of[weight] = key
        self.scales = {key: tensors.pop(key) for key in list(self.scale_of.values())}

    def check(self, key: str, shape: list[int], file) -> None:
        """A quantized weight's scale tensor has one entry per block."""
        if key not in self.scale_of:
            return
        handle = self.scales[self.scale_of[key]][0]
        want = [-(-size // block) for size, block in zip(shape, self.block)]
        got = list(handle.get_slice(self.scale_of[key]).get_shape())
        if got != want:
            raise HFConversionError(f"{file}: {self.scale_of[key]} has shape {got} but {key} {shape} in blocks of "
                                    f"{list(self.block)} needs {want}; the checkpoint is damaged")

    def rows(self, handle, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        """Rows `[first, first + count)` of tensor `key` (all of them when `first` is None), fp32."""
        part = handle.get_slice(key)
        values = part[:] if first is None else part[first:first + count]
        if key not in self.scale_of:
            return values.float()
        first = first or 0
        rows_per, columns_per = self.block
        low, high = first // rows_per, -(-(first + values.shape[0]) // rows_per)
        scale = self.scales[self.scale_of[key]][0].get_slice(self.scale_of[key])[low:high].float()
        scale = scale.repeat_interleave(rows_per, 0).repeat_interleave(columns_per, 1)
        offset = first - low * rows_per
        return values.float() * scale[offset:offset + values.shape[0], : values.shape[1]]
