"""The cluster a plan is made for: nodes of GPUs, their memories, links and peak speed.

Presets are 8-GPU HGX/DGX nodes with the SXM parts (every field can be overridden on the command
line). Bandwidths are per GPU and per direction, the figure a collective's bytes divide by:
- NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU, 450e9 B/s each way; collectives reach
  about 80% of it (NCCL all-to-all and all-gather bus bandwidth within a node);
- network: one 400 Gb/s ConnectX-7 NIC per GPU (the DGX H100/H200 design), 50e9 B/s, about 80%;
- host link: PCIe Gen5 x16, 64e9 B/s each way, about 80% with pinned memory.
The `_EFFICIENCY` factor is applied to the three links alike.
Device memory is what `torch.cuda.get_device_properties().total_memory` reports (H100 SXM 80 GB:
79.1 GiB; H200 SXM 141 GB: 139.8 GiB); `reserve_bytes` is held back for the CUDA context, NCCL's
buffers and the caching allocator's fragmentation, which the memory model does not count. Host
memory: 2 TiB per node (DGX H100 and H200 ship with 2 TB). Peak: bf16 dense tensor-core FLOP/s
(`mop.flops.PEAK_BF16_FLOPS`), of which `mfu` is assumed to be reached on the model's FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mop.config import ConfigError
from mop.flops import PEAK_BF16_FLOPS

GIB = 2**30
_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Cluster:
    nodes: int
    """Nodes of the cluster."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    gpu: str
    """The GPU's name (a preset: h100, h200)."""
    device_bytes: int
    """Memory of one GPU."""
    host_bytes: int
    """Host memory of one node."""
    nvlink_bytes_per_s: float
    """Within a node, per GPU and direction, as collectives reach it."""
    network_bytes_per_s: float
    """Between nodes, per GPU and direction, as collectives reach it."""
    host_link_bytes_per_s: float
    """Between a GPU and host memory, per direction."""
    peak_flops: float
    """bf16 dense peak FLOP/s of one GPU."""
    mfu: float = 0.4
    """The share of the peak the model's FLOPs are assumed to run at."""
    reserve_bytes: int = 6 * GIB
    """Device memory held back from the plan (CUDA context, NCCL buffers, fragmentation)."""
    unified_memory: bool = False
    """Host and device are one memory (a CPU run): a rank's host bytes count against its device budget."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget_bytes(self) -> int:
        """Device memory a rank's tensors may use."""
        return self.device_bytes - self.reserve_bytes


PRESETS = {
    "h100": Cluster(1, 8, "h100", int(79.1 * GIB), 2048 * GIB, 450e9 * _EFFICIENCY, 50e9 * _EFFICIENCY,
                    64e9 * _EFFICIENCY, PEAK_BF16_FLOPS["H100"]),
    "h200": Cluster(1, 8, "h200", int(139.8 * GIB), 2048 * GIB, 450e9 * _EFFICIENCY, 50e9 * _EFFICIENCY,
                    64e9 * _EFFICIENCY, PEAK_BF16_FLOPS["H200"]),
}


# Command-line overrides: option -> (field, factor to the field's unit).
OVERRIDES = {"device_gib": ("device_bytes", GIB), "reserve_gib": ("reserve_bytes", GIB), "host_gib": ("host_bytes", GIB),
             "nvlink_gbps": ("nvlink_bytes_per_s", 1e9), "network_gbps": ("network_bytes_per_s", 1e9),
             "host_link_gbps": ("host_link_bytes_per_s", 1e9), "peak_tflops": ("peak_flops", 1e12), "mfu": ("mfu", 1)}


def make_cluster(gpu: str, nodes: int, gpus_per_node: int, **overrides: float | None) -> Cluster:
    """A preset node type times `nodes`, with the given `OVERRIDES` (None: the preset's value);
    a bad value raises ConfigError naming its command-line option."""
    if gpu not in PRESETS:
        raise ConfigError("--gpu", f"unknown GPU {gpu!r}; choose one of {', '.join(PRESETS)}")
    for option, value in {"nodes": nodes, "gpus_per_node": gpus_per_node}.items():
        if value < 1:
            raise ConfigError(f"--{option.replace('_', '-')}", f"must be >= 1, got {value}")
    fields = {}
    for option, value in overrides.items():
        if value is None:
            continue
        name, unit = OVERRIDES[option]
        low_ok = option == "reserve_gib" and value == 0
        if not math.isfinite(value) or not (value > 0 or low_ok) or (option == "mfu" and value > 1):
            bound = "in (0, 1]" if option == "mfu" else ">= 0" if option == "reserve_gib" else "> 0"
            raise ConfigError(f"--{option.replace('_', '-')}", f"must be {bound}, got {value:g}")
        fields[name] = type(getattr(PRESETS[gpu], name))(value * unit)
    cluster = dataclasses.replace(PRESETS[gpu], nodes=nodes, gpus_per_node=gpus_per_node, **fields)
    if cluster.reserve_bytes >= cluster.device_bytes:
        raise ConfigError("--reserve-gib", f"{cluster.reserve_bytes / GIB:g} GiB leaves nothing of the GPU's "
                          f"{cluster.device_bytes / GIB:g} GiB; lower it")
    return cluster


# A CPU rank as `mop train` runs it (`local_cluster`): its GEMM speed (nominal here; the fit passes
# what the ranks' matmul probe measured), gloo over loopback, memcpy to "host" memory (nominal: the
# fit compares layouts on one machine, where only the ratios between compute, exchanges and copies
# decide). `mfu`: the model's FLOPs run at about half the probe's rate on this CPU (issue 50's
# per-phase table: attention 0.31, experts 0.39, vocabulary 0.50 of it).
CPU = Cluster(1, 1, "cpu", 0, 0, 5e9, 5e9, 10e9, 1e11, mfu=0.5, reserve_bytes=0, unified_memory=True)


def local_cluster(device: str, world: int, node: int, budget_bytes: int, host_bytes: int,
                  compute_flops: int = 0) -> Cluster:
    """The machine a `mop train` run is fitted to (`mop.settle.fit`): `world` ranks in nodes of `node`,
    `budget_bytes` per rank; a CPU computing at `compute_flops` per rank (the probe's; 0: nominal);
    CUDA GPUs priced as the H200 preset, except their memory."""
    kind = CPU if device == "cpu" else PRESETS["h200"]
    if device == "cpu" and compute_flops:
        kind = dataclasses.replace(kind, peak_flops=float(compute_flops))
    return dataclasses.replace(kind, nodes=world // node, gpus_per_node=node, device_bytes=budget_bytes,
                               reserve_bytes=0, host_bytes=host_bytes)
