"""Parallelism techniques; ``mesh`` defines the rank layout every other technique is given."""

from mop.parallel.mesh import (
    DistLayout,
    Layout,
    LayoutError,
    TorchrunEnv,
    backend_for,
    device_for,
    init_distributed,
    set_rank_threads,
)

__all__ = [
    "DistLayout",
    "Layout",
    "LayoutError",
    "TorchrunEnv",
    "backend_for",
    "device_for",
    "init_distributed",
    "set_rank_threads",
]
