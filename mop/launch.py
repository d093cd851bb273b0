"""Starting local ranks: `launch` runs `parallel.nproc` processes of `mop.train.train` through torch's
elastic launcher (what torchrun uses), each a `worker` that turns a user error into one line and
exit code 2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid

from mop.config import Config, ConfigError, resolve
from mop.data import DataError
from mop.models.hf import HFConversionError
from mop.parallel.mesh import LayoutError
from mop.run_dir import resolve_run_dir
from mop.train import NothingToTrain, train

USER_ERRORS = (ConfigError, DataError, HFConversionError, LayoutError, NotImplementedError)
NOTHING_TO_TRAIN = 3  # the exit code of a resume with no step left to run


def launch(config: Config) -> list[dict]:
    """Start `parallel.nproc` local ranks with torch's elastic launcher; rank 0's records come back."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=resolve(config).parallel.nproc, run_id=f"mop-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1, start_method="spawn")
    if not config.log.run_dir:
        # Rank 0 writes the run directory; fixing it here keeps it the one the user is told about.
        config = dataclasses.replace(config, log=dataclasses.replace(config.log, run_dir=str(resolve_run_dir(config))))
    # The launcher's own log of a failed rank is a traceback of its process pool, not of the rank:
    # a rank's user error is already one line (`worker`), and `mop.cli` names any other failure.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # And the process pool's warning on each rank it terminates because another one failed.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)
    results = elastic_launch(launch_config, worker)(config)
    return results[0]


def worker(config: Config) -> list[dict]:
    """Entry point of a launched rank: user errors print one line (rank 0) and exit with code 2."""
    try:
        return train(config)
    except USER_ERRORS as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"mop: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except NothingToTrain as done:
        if os.environ.get("RANK", "0") == "0":
            print(f"mop: {done}", file=sys.stderr)
        raise SystemExit(NOTHING_TO_TRAIN) from None
