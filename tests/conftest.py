"""The CUDA tier: tests parametrised by `devices(world)` also run on CUDA (NCCL, one rank per GPU)
where there are enough GPUs, marked `cuda` (`pytest -m cuda` runs only them) and skipped otherwise.

The fast loop: `pytest -m "not slow"` over the whole suite must still touch every module of mop. When
it passes, the session fails if some module was never imported by it (a test marked slow that was a
module's only test would otherwise drop that module from the loop unnoticed). Keeping it fast is the
`slow` marker's job: the larger cases of a parametrised test and the trainer's launches are marked.
"""

import pkgutil
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_map

import mop
from mop.testing import cuda_ranks_available


def devices(world: int = 1) -> list:
    """pytest parameters "cpu" and "cuda"; the latter marked `cuda`, skipped without `world` GPUs."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not cuda_ranks_available(world), reason=f"needs {world} GPU(s), one per rank")])]


def to_cpu(tree):
    """A rank's results, every tensor copied to the CPU (to be compared with the reference there)."""
    return tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, tree)


def untouched_modules() -> list[str]:
    """mop's modules that this process has not imported."""
    names = [info.name for info in pkgutil.walk_packages(mop.__path__, "mop.")]
    return sorted(name for name in names if name not in sys.modules)


def runs_the_whole_fast_loop(config) -> bool:
    tests = Path(__file__).resolve().parent
    return (config.option.markexpr == "not slow" and not config.option.keyword and not config.option.collectonly
            and {Path(arg).resolve() for arg in config.args} <= {tests, tests.parent})


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.OK and runs_the_whole_fast_loop(session.config):
        missing = untouched_modules()
        if missing:
            pytest.exit(f"the fast loop (-m 'not slow') imports none of {', '.join(missing)}: "
                        "give each a test that is not marked slow", returncode=pytest.ExitCode.TESTS_FAILED)
