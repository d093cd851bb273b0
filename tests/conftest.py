"""The CUDA tier: tests parametrised by `devices(world)` also run on CUDA (NCCL, one rank per GPU)
where there are enough GPUs, marked `cuda` (`pytest -m cuda` runs only them) and skipped otherwise.

The fast loop: `pytest -m "not slow"` over the whole suite must still touch every module of mop. When
it passes, the session fails if some module was never imported by it (a test marked slow that was a
module's only test would otherwise drop that module from the loop unnoticed). Keeping it fast is the
`slow` marker's job: the larger cases of a parametrised test and the trainer's launches are marked.
Under pytest-xdist (`./mop.sh test` runs a worker per core) the check is the controller's, over the
union of the modules its workers imported.
"""

import os
import pkgutil
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_map

import mop
from mop.parallel.mesh import set_rank_threads
from mop.testing import cuda_ranks_available

# An xdist worker (`./mop.sh test` runs one per core) takes its share of the cores as torch's threads,
# so that n workers run n * share threads rather than n * cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    set_rank_threads(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_collection_modifyitems(config, items):
    """The engine tier (`-m engine`) runs only when asked for: its tests start a real vLLM from .venv-vllm,
    which `./mop.sh test -m engine` makes."""
    if "engine" in (config.option.markexpr or ""):
        return
    engine = [item for item in items if item.get_closest_marker("engine")]
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [item for item in items if not item.get_closest_marker("engine")]


def devices(world: int = 1) -> list:
    """pytest parameters "cpu" and "cuda"; the latter marked `cuda`, skipped without `world` GPUs."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not cuda_ranks_available(world), reason=f"needs {world} GPU(s), one per rank")])]


def to_cpu(tree):
    """A rank's results, every tensor copied to the CPU (to be compared with the reference there)."""
    return tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, tree)


def untouched_modules(imported) -> list[str]:
    """mop's modules that are not in `imported` (module names)."""
    names = [info.name for info in pkgutil.walk_packages(mop.__path__, "mop.")]
    return sorted(name for name in names if name not in imported)


def runs_the_whole_fast_loop(config) -> bool:
    tests = Path(__file__).resolve().parent
    return (config.option.markexpr == "not slow" and not config.option.keyword and not config.option.collectonly
            and {Path(arg).resolve() for arg in config.args} <= {tests, tests.parent})


# Under pytest-xdist (`./mop.sh test` runs `-n <cores>`) each worker imports what its share of the
# tests touches: a worker hands its modules to the controller, which checks their union.
WORKERS_IMPORTED = pytest.StashKey[set]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    imported = getattr(node, "workeroutput", {}).get("mop_modules", ())  # a worker that crashed sent none
    node.config.stash.setdefault(WORKERS_IMPORTED, set()).update(imported)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checks
        config.workeroutput["mop_modules"] = [name for name in sys.modules if name.startswith("mop.")]
        return
    if exitstatus == pytest.ExitCode.OK and runs_the_whole_fast_loop(config):
        missing = untouched_modules(set(sys.modules) | config.stash.get(WORKERS_IMPORTED, set()))
        if missing:
            pytest.exit(f"the fast loop (-m 'not slow') imports none of {', '.join(missing)}: "
                        "give each a test that is not marked slow", returncode=pytest.ExitCode.TESTS_FAILED)
