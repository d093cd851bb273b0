"""Rotary position embeddings: the default RoPE and YaRN, in the half-split convention.

RoPE turns each pair of dims (i, i + d/2) of a head by the angle `position x inv_freq[i]`; the
tables are computed in fp32 and cast to the activation dtype, as Hugging Face's models do, so that
converted checkpoints compute the same numbers. Interleaved checkpoints (DeepSeek-V3's
`rope_interleave`, pairs (2i, 2i + 1)) are served by `deinterleave`: gathering the even dims then
the odd ones turns them into the half-split layout, after which the same rotation is bit-identical
to the interleaved one (q and k are permuted alike, so their dot products are unchanged).

YaRN (Peng et al. 2023, as transformers' `_compute_yarn_parameters`): the inverse frequencies
blend interpolation (`inv_freq / factor`) and extrapolation along a linear ramp between the
correction dims of `beta_fast` and `beta_slow` rotations over `original_context` tokens (rounded
outwards when `truncate`); cos and sin are multiplied by the attention factor, which is
`mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set, else
`mscale(factor)`, with `mscale(s, m) = 0.1 m ln s + 1` (1 for s <= 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnOptions:
    """YaRN context extension, as options of the families that use it (their `Options` derive from
    this class); `yarn_factor` 1 is the default RoPE."""

    yarn_factor: float = 1.0
    """Context extension factor (HF `rope_parameters.factor`); 1 means plain RoPE."""
    yarn_original_context: int = 4096
    """The pre-training context the ramp is measured on (`original_max_position_embeddings`)."""
    yarn_beta_fast: float = 32.0
    """Rotations below which a dim is extrapolated (`beta_fast`)."""
    yarn_beta_slow: float = 1.0
    """Rotations above which a dim is interpolated (`beta_slow`)."""
    yarn_mscale: float = 0.0
    """`mscale` of the attention factor (0: unset)."""
    yarn_mscale_all_dim: float = 0.0
    """`mscale_all_dim` of the attention factor (0: unset); DeepSeek-V3 also scales its softmax by it."""
    yarn_truncate: bool = True
    """Round the ramp's correction dims outwards (`truncate`; gpt-oss turns it off)."""

    def yarn_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.yarn_factor < 1:
            problems.append(("yarn_factor", f"must be >= 1 (1 is plain RoPE), got {self.yarn_factor}"))
        if self.yarn_original_context < 1:
            problems.append(("yarn_original_context", "must be >= 1"))
        return problems

    @property
    def yarn(self) -> bool:
        return self.yarn_factor != 1

    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 without YaRN)."""
        if not self.yarn:
            return 1.0
        if self.yarn_mscale and self.yarn_mscale_all_dim:
            return yarn_mscale(self.yarn_factor, self.yarn_mscale) / yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim)
        return yarn_mscale(self.yarn_factor)

    def inv_freq(self, dim: int, theta: float, device=None) -> torch.Tensor:
        """fp32 inverse frequencies `[dim / 2]` of a `dim`-wide rotary part, made on `device`."""
        if not self.yarn:
            return default_inv_freq(dim, theta, device)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.yarn_original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.yarn_beta_fast), correction_dim(self.yarn_beta_slow)
        if self.yarn_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as the reference: a ramp of zero width would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp
        # written as the reference writes it, so the tables agree to the last bit
        frequencies = _frequencies(dim, theta, device)
        return 1.0 / (self.yarn_factor * frequencies) * (1 - extrapolated) + 1.0 / frequencies * extrapolated


def _frequencies(dim: int, theta: float, device) -> torch.Tensor:
    return theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def default_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """Made on the positions' device each call (a few elements): no host copy in a layer."""
    return 1.0 / _frequencies(dim, theta, device)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """cos/sin tables `[..., 2 len(inv_freq)]` for the given (global) positions, times `factor`."""
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, S, heads, dim]` by the tables `cos, sin [B, S, dim]`."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (2i, 2i + 1) -> the half-split layout (i, i + dim / 2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
