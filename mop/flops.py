"""Model FLOPs and MFU: the work a training step must do, whatever the layout or the recomputation.

The FLOPs per trained token are the model family's (`mop.models.spec.ModelSpec.flops_per_token`,
which states the convention: causal attention counts the keys a query really attends,
`attended_keys` below). Activation-checkpointing recomputation, LLEP's extra chunk work and the
vocabulary ring's recomputed logits are not model FLOPs: MFU is model FLOPs / step time / peak.

Peak: bf16 dense tensor-core FLOP/s of the device, from its name (H100 / H200 SXM 989e12, their
PCIe / NVL cards less, A100 312e12); unknown devices give no MFU.
"""

from __future__ import annotations

import torch

# bf16 dense peaks by device name, most specific first: the PCIe and NVL cards run lower clocks.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12,
                   "A100": 312e12}


def attended_keys(position_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The keys each token attends causally: its position in its document + 1 (positions restart
    at every document, and under sequence parallelism they are the global ones), at most `window`
    in a sliding-window layer (the window counts the query itself)."""
    keys = position_ids + 1
    return keys if window is None else keys.clamp(max=window)


def mean_attended_keys(length: int, window: int | None = None) -> float:
    """`attended_keys` averaged over the tokens of a `length`-token document."""
    seen = length if window is None else min(window, length)
    return (seen * (seen + 1) / 2 + (length - seen) * seen) / length


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak FLOP/s, when its name is known (CUDA only)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
