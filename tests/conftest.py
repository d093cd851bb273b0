"""The CUDA tier: tests parametrised by `devices(world)` also run on CUDA (NCCL, one rank per GPU)
where there are enough GPUs, marked `cuda` (`pytest -m cuda` runs only them) and skipped otherwise."""

import pytest
import torch
from torch.utils._pytree import tree_map

from mop.testing import cuda_ranks_available


def devices(world: int = 1) -> list:
    """pytest parameters "cpu" and "cuda"; the latter marked `cuda`, skipped without `world` GPUs."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not cuda_ranks_available(world), reason=f"needs {world} GPU(s), one per rank")])]


def to_cpu(tree):
    """A rank's results, every tensor copied to the CPU (to be compared with the reference there)."""
    return tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, tree)
