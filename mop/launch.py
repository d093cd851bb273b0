"""Starting local ranks: `launch` runs `parallel.nproc` processes of `mop.train.train` through torch's
elastic launcher (what torchrun uses), each a `worker`.

A rank's user error (or a collective timeout) is not printed by the rank: the worker records its
one line in torch elastic's error file for the launcher and exits with code 2 (1 for a timeout),
and `failed_launch` prints the first one once, whichever rank raised it. A rank stopped by a
signal prints (rank 0) how to resume and exits with 128 + the signal number.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import typing
import uuid

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from mop.config import Config, ConfigError
from mop.data import DataError
from mop.faults import CollectiveTimeout, PeerLost, Stopped, launch_failure, recorded_error, secondary
from mop.models.hf import HFConversionError
from mop.parallel.mesh import LayoutError
from mop.run_dir import resolve_run_dir
from mop.settle import ResolvedConfig
from mop.train import NothingToTrain, train

USER_ERRORS = (ConfigError, DataError, HFConversionError, LayoutError, NotImplementedError)
ONE_LINE_ERRORS = (*USER_ERRORS, CollectiveTimeout)  # what a rank records for the launcher to print
RUN_ENDED = (NothingToTrain, Stopped)  # not errors: rank 0 says why, and the exit code is theirs


def launch(config: ResolvedConfig) -> list[dict]:
    """Start `parallel.nproc` local ranks with torch's elastic launcher; rank 0's records come back.
    Each rank is given `config` as resolved here (for this world), and uses it as it is."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=config.parallel.nproc, run_id=f"mop-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1, start_method="spawn",
        **stop_grace(config, LaunchConfig))
    if not config.log.run_dir:
        # Rank 0 writes the run directory; fixing it here keeps it the one the user is told about.
        config = dataclasses.replace(config, log=dataclasses.replace(config.log, run_dir=str(resolve_run_dir(config))))
    # The launcher's own log of a failed rank is a traceback of its process pool, not of the rank:
    # a rank's user error is already one line (`worker`), and `mop.cli` names any other failure.
    # Its modules' loggers each set their own level, so the family is cut off at its root instead;
    # and the process pool's line on each rank it terminates after another failed.
    for family in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
        logging.getLogger(family).addHandler(logging.NullHandler())
        logging.getLogger(family).propagate = False
    # A rank killed by a signal cannot release its queues' semaphores; multiprocessing's resource
    # tracker (a process started with this interpreter's warning options) releases them, and would
    # warn about each one on the terminal.
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet_tracker not in sys.warnoptions:
        sys.warnoptions.append(quiet_tracker)
    results = elastic_launch(launch_config, worker)(config)
    return results[0]


def stop_grace(config: Config, launch_config_type: type) -> dict:
    """The launcher's grace for ranks saving after SIGTERM, where this torch's launcher takes one
    (`LaunchConfig.shutdown_timeout`, torch 2.13+); torch 2.11's waits a fixed 30 s, and
    `checkpoint.stop_grace_s` is then not used (its docstring says so)."""
    takes = "shutdown_timeout" in {f.name for f in dataclasses.fields(launch_config_type)}
    return {"shutdown_timeout": config.checkpoint.stop_grace_s} if takes else {}


def worker(config: Config) -> list[dict]:
    """Entry point of a launched rank (see the module docstring for what it says and its exit codes)."""
    try:
        return train(config)
    except ONE_LINE_ERRORS as err:
        ErrorHandler().record_exception(err)  # "<type>: <message>", read back by `failed_launch`
        code = 2 if isinstance(err, USER_ERRORS) else 1
    except RUN_ENDED as ended:
        code = say_run_ended(ended)
    except PeerLost as lost:  # the launcher names the rank that stopped first
        code = lost.exit_code
    leave(code)


def leave(code: int) -> typing.NoReturn:
    """End a rank whose run failed or ended early with exit code `code`, its run freed first.

    The error's traceback holds the run (its tensors, the last references to its process groups,
    DCP's plans) in reference cycles that only the garbage collector frees. Left to the interpreter's
    teardown, that collection destroys gloo's process groups and their pending work while the
    interpreter is going away; a gloo thread that then needs the GIL to drop a tensor is ended by it
    (pthread_exit) inside C++ code, which aborts the process (`terminate called without an active
    exception`, SIGABRT): a rank that had recorded a user error exited with 250, not 2. Freed here,
    with the error already out of scope, they go while the interpreter is whole."""
    gc.collect()
    raise SystemExit(code)


def say_run_ended(ended: NothingToTrain | Stopped) -> int:
    """Rank 0 (or the only process) says why the run ended early; returns the exit code."""
    if os.environ.get("RANK", "0") == "0":
        print(f"mop: {ended}", file=sys.stderr)
    return ended.exit_code


def failed_launch(failures: dict) -> tuple[int, str | None]:
    """The exit code of a launch whose ranks failed (`failures`: rank -> torch elastic's
    ProcessFailure) and the one line to print, if the ranks have not said it already.

    The first recorded one-line error (by time, then rank) is printed once; ranks that only
    stopped because another failed are not the cause (`mop.faults.secondary`)."""
    causes = {rank: f for rank, f in failures.items() if not secondary(f)}
    if not causes:  # every rank stopped on a signal, after saving (rank 0 said so) or not
        return max(f.exitcode if f.exitcode > 0 else 128 - f.exitcode for f in failures.values()), None
    recorded = sorted((f.timestamp, rank) for rank, f in causes.items() if recorded_error(f, ONE_LINE_ERRORS))
    if recorded:
        first = causes[recorded[0][1]]
        return first.exitcode, f"mop: error: {recorded_error(first, ONE_LINE_ERRORS)}"
    if {f.exitcode for f in causes.values()} == {NothingToTrain.exit_code}:
        return NothingToTrain.exit_code, None
    # a failure that is no user error is a bug: its traceback is what says where (the launcher's
    # loggers, which would print it, are cut off above)
    return 1, "".join(rank_tracebacks(causes)) + f"mop: error: {launch_failure(failures)}"


def rank_tracebacks(causes: dict) -> list[str]:
    """The tracebacks the failed ranks recorded (torch elastic's error files), each under its rank."""
    out = []
    for rank, failure in sorted(causes.items()):
        recorded = failure.message if isinstance(failure.message, dict) else {}
        stack = recorded.get("extraInfo", {}).get("py_callstack")
        if stack:
            out.append(f"[rank {rank}] {stack.rstrip()}\n")
    return out
