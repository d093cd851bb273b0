"""Model FLOPs and MFU: the work a training step must do, whatever the layout or the recomputation.

The FLOPs per trained token are the model family's (`mop.models.spec.ModelSpec.flops_per_token`,
which states the convention: causal attention counts the keys a query really attends,
`attended_keys` below). Activation-checkpointing recomputation, LLEP's extra chunk work and the
vocabulary ring's recomputed logits are not model FLOPs: MFU is model FLOPs / step time / peak.

Peak: bf16 dense tensor-core FLOP/s of the device, from its name (H100 / H200 SXM 989e12, their
PCIe / NVL cards less, A100 312e12), for a run computing in bf16; otherwise (a CPU, an unlisted GPU,
another dtype) the rate a short matrix-multiply probe measures at start-up (`matmul_probe`: square
GEMMs in the run's compute dtype on its device, each rank at once, so a shared machine's ranks
measure what each gets; once per process, device and dtype). Every record carries the probe's
figure beside the peak MFU divides by (`Peak`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

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


def phase_flops(spec, model_flops: float, positions: int) -> dict[str, float]:
    """A step's model FLOPs split over `mop.profiling`'s phases: "vocabulary" the heads' logits (the
    model's and each MTP depth's), "experts" the routed experts' GEMMs, "attention" the cores (what
    the matrix multiplies leave of `model_flops`), "other" the remaining GEMMs (projections,
    routers, shared experts, dense MLPs); `positions`: the step's token positions, padding included,
    as `model_flops` counts them; `spec` the model's `mop.models.spec.ModelSpec`."""
    m = spec.cfg
    matmul = 6 * spec.matmul_parameters_per_token() * positions
    vocabulary = 6 * m.hidden * m.vocab_size * (1 + m.trained_mtp_layers) * positions
    experts = 3 * spec.routed_expert_flops() * positions
    return {"attention": model_flops - matmul, "experts": experts, "vocabulary": vocabulary,
            "other": matmul - experts - vocabulary}


PROBE_SIZE = {"cuda": 8192, "cpu": 1024}  # the probe's square GEMM side, per device type
PROBE_SECONDS = 0.25  # the probe's timed span, after one warm-up GEMM


def matmul_probe(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of square GEMMs (`PROBE_SIZE`) in `dtype` on `device`, timed over `PROBE_SECONDS`: what
    this process's matrix multiplies reach with its intra-op threads as they are now, measured once
    per process and thread count (cached)."""
    return _probe(device, dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _probe(device: torch.device, dtype: torch.dtype, threads: int) -> float:
    """`matmul_probe` at `threads` intra-op threads (the cache's key)."""
    n = PROBE_SIZE.get(device.type, PROBE_SIZE["cpu"])
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)
    _synchronize(device)
    start, done = time.perf_counter(), 0
    while True:
        torch.matmul(a, b, out=out)
        done += 1
        _synchronize(device)  # at start-up, not in a step: the GEMMs must have run to be timed
        elapsed = time.perf_counter() - start
        if elapsed >= PROBE_SECONDS:
            return 2 * n**3 * done / elapsed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Peak:
    """What a run's MFU divides by (module docstring)."""

    flops: float
    """FLOP/s per rank: the table's bf16 peak for a known GPU computing in bf16, else the probe's."""
    probe: float
    """The matrix-multiply probe's FLOP/s per rank (`matmul_probe`, averaged over the ranks)."""
    source: str
    """"table" or "probe"."""

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype, probe: float) -> "Peak":
        table = peak_flops(device) if dtype == torch.bfloat16 else None
        return cls(table, probe, "table") if table else cls(probe, probe, "probe")

    def record(self, flops_per_rank: float) -> dict:
        """A step's MFU at `flops_per_rank` model FLOP/s, with the peak and the probe's figure (TFLOP/s)."""
        return {"mfu": flops_per_rank / self.flops, "peak_tflops": self.flops / 1e12, "probe_tflops": self.probe / 1e12}
