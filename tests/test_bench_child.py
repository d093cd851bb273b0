"""A benchmark's child commands end with it (`mop.bench.child`): on a timeout, on SIGTERM to the
benchmark, and when the child returns leaving something behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mop.bench import child

ROOT = Path(__file__).resolve().parents[1]


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def ended(pids: set[int], within: float = 10.0) -> set[int]:
    """Those of `pids` still running after waiting up to `within` seconds for them to end."""
    deadline = time.monotonic() + within
    while (left := {pid for pid in pids if running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_child_that_outlives_its_time_is_ended_with_what_it_started(tmp_path):
    started = tmp_path / "started"
    command = ["bash", "-c", f"sleep 120 > /dev/null & echo $! > {started}; wait"]
    with pytest.raises(subprocess.TimeoutExpired):
        child.run(command, timeout=5)
    assert started.exists(), "the child had not started its own child within the timeout"
    assert ended({int(started.read_text())}) == set()


def test_what_a_returned_child_left_running_is_ended():
    done = child.run(["bash", "-c", "sleep 120 > /dev/null 2>&1 & echo $!"], timeout=60)
    assert done.returncode == 0
    assert ended({int(done.stdout)}) == set()


def test_the_process_tree_holds_the_child_and_what_it_started():
    with child.session(["bash", "-c", "sleep 120 & wait"]) as process:
        def names(tree):
            return sorted(status["Name"].strip() for status in tree.values())

        # The forked child is named bash until it has exec'd sleep: wait for the exec, not only the fork.
        deadline, tree = time.monotonic() + 30, {}
        while names(tree) != ["bash", "sleep"] and time.monotonic() < deadline:
            tree = child.process_tree(process.pid)
            time.sleep(0.05)
        assert names(tree) == ["bash", "sleep"]
        assert process.pid in tree


def test_sigterm_raises_stopped_inside_and_the_previous_handler_comes_back():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(child.Stopped) as stop, child.stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # cut short by the handler's exception
    assert stop.value.signum == signal.SIGTERM and isinstance(stop.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.slow
def test_sigterm_to_a_benchmark_ends_the_training_runs_it_started_and_says_so_in_one_line(tmp_path):
    command = [sys.executable, "-m", "mop.cli", "bench", "context", "--contexts=", "--plain-context=0",
               f"--out={tmp_path / 'context.json'}"]
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline, runs = time.monotonic() + 240, set()
        while len(runs) < 4 and time.monotonic() < deadline and bench.poll() is None:
            runs = set(child.process_tree(bench.pid)) - {bench.pid}  # `mop train`, its tracker, its 2 ranks
            time.sleep(0.2)
        assert len(runs) >= 4, f"the benchmark's training run never started its ranks: {bench.communicate()}"
        bench.send_signal(signal.SIGTERM)
        out, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "mop: bench stopped by SIGTERM"
    assert ended(runs) == set()
