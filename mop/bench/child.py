"""A benchmark's child commands (`mop train`, `mop data prepare`, the test suite), ended whole with it.

Each child runs in a session of its own (`start_new_session`), and everything in that session (the
child, the ranks it launched, their helpers) is killed when the child outlives its time, when the
benchmark is stopped, or when the child returns and left something behind. A benchmark is stopped
by Ctrl-C, or by SIGTERM (`kill`, `timeout`, a scheduler), which `mop bench` raises as Ctrl-C's
`KeyboardInterrupt` does (`stop_on_sigterm`).

Why: a child in the benchmark's own process group gets Ctrl-C from the terminal, but a SIGTERM sent
to the benchmark alone killed it and left its `mop train` and that run's ranks computing; a timeout
killed `mop train`, whose ranks ran on to the end of their step, and `mop.sh test` but not its
pytest. On a 2-core machine the strays skew what is measured next: `mop bench context`'s first run
beside them read 21.0 s per 16K step (its first step 37 s) where a clean invocation read 17.1 s.
Being ended this way, a child saves nothing on its way out (a stopped `mop train` would otherwise
checkpoint): a benchmark's runs are not kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path


class Stopped(KeyboardInterrupt):
    """SIGTERM during a benchmark, raised where Ctrl-C raises `KeyboardInterrupt`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises `Stopped` in the main thread while inside; the previous handler after."""
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def session(command: list[str], **popen: object) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command, **popen)` in a session of its own, killed whole (SIGKILL) on leaving,
    however the block is left; then its pipes are closed and the child is reaped."""
    with subprocess.Popen(command, start_new_session=True, **popen) as process:  # leaving it: pipes closed, reaped
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the session's id is the child's pid


def run(command: list[str], timeout: float | None = None, **popen: object) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen)` in a session
    of its own (`session`): `subprocess.TimeoutExpired` when it outlives `timeout`, the session killed."""
    with session(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def process_tree(root: int) -> dict[int, dict[str, str]]:
    """The `/proc/PID/status` fields of process `root` and of every process below it (by parent ids),
    of those still there."""
    statuses = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines = (entry / "status").read_text().splitlines()
            except OSError:  # ended since the listing
                continue
            statuses[int(entry.name)] = dict(line.split(":", 1) for line in lines if ":" in line)
    parents = {pid: int(status["PPid"]) for pid, status in statuses.items()}
    tree, grew = {root}, True
    while grew:
        grown = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= grown
        grew = bool(grown)
    return {pid: statuses[pid] for pid in tree if pid in statuses}
