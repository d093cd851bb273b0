"""Faults: a stop signal (preemption), a rank killed mid-run, the whole run killed during a save,
a checkpoint directory that turns read-only, a hung collective; what each says and what survives.

The end-to-end cases run `mop train` on 2 launched ranks in a subprocess (its own session, so a
signal can reach every process of the run, as Slurm's and a terminal's do). Faults are injected
into the ranks by a `sitecustomize` module on PYTHONPATH, imported by every Python process at
start-up (before a launched rank has its RANK: the hooks read it when called): it wraps one
function of the ranks (`mop.train.train_step` or DCP's save). After each
fault, no earlier checkpoint is damaged and resuming continues the uninterrupted loss curve:
exactly on the same layout, within 1e-4 on another.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from mop.cli import main
from mop.faults import StopRequest, collective_timeout, launch_failure
from mop.launch import failed_launch
from mop.metrics import read_metrics
from mop.parallel.mesh import DistLayout, Layout
from mop.testing import rank_device, run_distributed
from servers import free_port
from test_train import TINY, TINY_RUN

STEPS = 12
TWO_RANKS = [*TINY_RUN, "--parallel.strategy=mop", "--parallel.nproc=2", f"--train.steps={STEPS}",
             "--checkpoint.every=2", "--checkpoint.keep=5"]
ONE_PROCESS = [*TINY, f"--train.steps={STEPS}", "--checkpoint.every=2", "--checkpoint.keep=5"]


def start(run_dir: Path, inject: str = "", *extra: str) -> subprocess.Popen:
    """`mop train` on 2 ranks in its own session; `inject`: the ranks' sitecustomize source."""
    env = dict(os.environ)
    if inject:
        hooks = run_dir.parent / f"{run_dir.name}-hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(textwrap.dedent(inject))
        env["PYTHONPATH"] = os.pathsep.join([str(hooks), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "mop.cli", "train", *TWO_RANKS, f"--log.run_dir={run_dir}", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """The exit code and the non-blank stderr lines of a run."""
    _, err = proc.communicate(timeout=300)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{what} never happened; the run said: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=lambda n: (len(n), n))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "uninterrupted"
    code, err = finish(start(run_dir))
    assert code == 0, err
    return losses(run_dir)


def resume_here(run_dir: Path) -> list[float]:
    """Resume the run on its own layout (2 ranks) and return its whole loss curve."""
    code, err = finish(start(run_dir, "", "--checkpoint.resume=latest"))
    assert code == 0, err
    return losses(run_dir)


def resume_in_one_process(run_dir: Path, checkpoint: str) -> list[float]:
    """Resume the run's `checkpoint` on another layout (the reference strategy, one process)."""
    other = run_dir.parent / f"{run_dir.name}-elsewhere"
    assert main(["train", *ONE_PROCESS, f"--log.run_dir={other}",
                 f"--checkpoint.resume={run_dir / 'checkpoints' / checkpoint}"]) == 0
    return losses(other)


@pytest.mark.slow
def test_sigterm_mid_step_saves_and_the_resumed_run_continues_the_curve(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 3, "step 3", proc)
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the run, as Slurm and Ctrl-C do
    code, err = finish(proc)
    assert code == 128 + signal.SIGTERM and len(err) == 1, err
    assert err[0].startswith("mop: stopped by SIGTERM after step ") and "--checkpoint.resume=latest" in err[0]
    step = int(err[0].split("after step ")[1].split()[0])
    assert step < STEPS and f"step_{step}" in checkpoints(run_dir)
    elsewhere = resume_in_one_process(run_dir, f"step_{step}")
    assert resume_here(run_dir) == uninterrupted
    assert elsewhere == pytest.approx(uninterrupted[step:], rel=1e-4)


KILL_RANK_1_IN_STEP_5 = """
    import os, signal
    import mop.train
    run_step, calls = mop.train.train_step, []
    def train_step(run, batches, *rest):
        calls.append(1)
        if len(calls) == 6 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return run_step(run, batches, *rest)
    mop.train.train_step = train_step
"""


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_and_the_run_resumes_exactly(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    code, err = finish(start(run_dir, KILL_RANK_1_IN_STEP_5))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("mop: error: rank(s) 1 killed by SIGKILL, usually the out-of-memory killer"), err
    assert checkpoints(run_dir) == ["step_2", "step_4"]
    assert resume_here(run_dir) == uninterrupted


def dcp_save_hook(on_second_save: str) -> str:
    """sitecustomize source: DCP's second save in each rank runs `on_second_save` (after writing
    its shards when the code calls `write()`, before otherwise)."""
    return f"""
    import errno, time
    from pathlib import Path
    import torch.distributed.checkpoint as dcp
    original, calls = dcp.save, []
    def save(state, checkpoint_id, **kwargs):
        calls.append(1)
        write = lambda: original(state, checkpoint_id=checkpoint_id, **kwargs)
        if len(calls) == 2:
            {on_second_save}
        return write()
    dcp.save = save
    """


KILLED_DURING_A_SAVE = dcp_save_hook("write(); (Path(checkpoint_id).parent / 'saving').touch(); time.sleep(120)")
READ_ONLY_AT_THE_SECOND_SAVE = dcp_save_hook("raise OSError(errno.EROFS, 'Read-only file system', str(checkpoint_id))")


@pytest.mark.slow
def test_a_run_killed_during_a_save_keeps_its_earlier_checkpoints(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(run_dir, KILLED_DURING_A_SAVE)
    wait_for(lambda: (run_dir / "checkpoints/saving").exists(), "the second save", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert checkpoints(run_dir) == ["saving", "step_2", "step_4.partial"]  # written, never completed
    assert resume_in_one_process(run_dir, "step_2") == pytest.approx(uninterrupted[2:], rel=1e-4)
    assert resume_here(run_dir) == uninterrupted
    assert "step_4.partial" not in checkpoints(run_dir)  # the next save cleared it


@pytest.mark.slow
def test_a_checkpoint_directory_turned_read_only_is_one_line_and_loses_nothing(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    code, err = finish(start(run_dir, READ_ONLY_AT_THE_SECOND_SAVE))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"mop: error: checkpoint.dir: {run_dir / 'checkpoints'} cannot be written "
                             "([Errno 30] Read-only file system"), err
    assert checkpoints(run_dir) == ["step_2", "step_4.partial"]
    assert losses(run_dir) == uninterrupted[:4]
    # step_2 continues the curve; resuming the run's own directory past its step_4.partial is the test
    # above's (the same folders after a save killed mid-way).
    assert resume_in_one_process(run_dir, "step_2") == pytest.approx(uninterrupted[2:], rel=1e-4)


def test_a_stop_signal_is_recorded_once_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert stop.agreed(None, torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(None, torch.device("cpu")) == signal.SIGTERM  # the first one
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _stop_agreed(rank: int, world: int):
    layout = DistLayout(Layout(world), rank_device())
    stop = StopRequest()
    stop.signal = signal.SIGINT if rank == 1 else None
    return stop.agreed(layout.world_group, rank_device())


def test_a_signal_seen_by_one_rank_stops_every_rank():
    assert run_distributed(_stop_agreed, 2) == [signal.SIGINT, signal.SIGINT]


def _wait_in_a_collective_a_peer_never_joins(rank: int, world: int):
    # A group of its own (a mesh dimension over the whole world is the default group itself): a
    # gloo timeout closes the group's connections, and the harness ends with a default-group barrier.
    layout = DistLayout(Layout(world, expert=world), rank_device(), timeout=timedelta(seconds=2))
    outcome = None
    if rank == 1:
        time.sleep(8)
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=layout.expert_p2p_group)
            outcome = "returned", None
        except RuntimeError as err:
            outcome = str(collective_timeout(err)), time.monotonic() - start
    _set_pg_timeout(timedelta(seconds=60), layout.world_group)  # for the harness's closing barrier
    return outcome


@pytest.mark.slow
def test_a_hung_collective_is_named_within_the_timeout():
    (message, waited), _ = run_distributed(_wait_in_a_collective_a_peer_never_joins, 2)
    assert message.startswith("parallel.timeout_s: all_reduce over the llep_weights group waited longer than the timeout "
                              "(in test_faults.py:"), message
    assert "_wait_in_a_collective_a_peer_never_joins" in message and waited < 6


def failure(exitcode: int, message: str = "", timestamp: int = 0):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp)


def test_the_launcher_prints_the_first_recorded_error_once_from_any_rank():
    stopped = 128 + signal.SIGTERM  # a rank the launcher stopped after another failed
    data = failure(2, {"message": "DataError: data.source: x.txt is empty; add text", "extraInfo": {}}, timestamp=5)
    assert failed_launch({0: failure(stopped), 1: data}) == (2, "mop: error: data.source: x.txt is empty; add text")
    later = failure(2, "ConfigError: checkpoint.dir: later", timestamp=9)
    assert failed_launch({0: later, 1: data})[1] == "mop: error: data.source: x.txt is empty; add text"
    timeout = failure(1, "CollectiveTimeout: parallel.timeout_s: all_reduce ...")
    assert failed_launch({0: timeout, 1: failure(4)}) == (1, "mop: error: parallel.timeout_s: all_reduce ...")
    assert failed_launch({0: failure(stopped), 1: failure(stopped)}) == (stopped, None)  # rank 0 said what it saved
    assert failed_launch({0: failure(-signal.SIGTERM), 1: failure(stopped)}) == (stopped, None)
    assert failed_launch({0: failure(3), 1: failure(3)}) == (3, None)


def test_a_rank_killed_by_a_signal_is_named_with_the_likely_cause():
    stopped = 128 + signal.SIGTERM
    killed = launch_failure({0: failure(stopped), 1: failure(-signal.SIGKILL)})
    assert killed.startswith("rank(s) 1 killed by SIGKILL, usually the out-of-memory killer (host memory)")
    assert "data.seq_len" in killed
    assert "parallel.timeout_s" in launch_failure({0: failure(-signal.SIGABRT)})
    assert "/dev/shm" in launch_failure({1: failure(-signal.SIGBUS)})
    assert launch_failure({1: failure(1), 0: failure(4)}) == "rank(s) 1 failed; their tracebacks are above"
    assert launch_failure({1: failure(4), 0: failure(4)}).startswith("the ranks lost their connections")
    assert failed_launch({0: failure(1), 1: failure(-signal.SIGKILL)})[0] == 1


def test_a_rank_failing_on_a_bug_shows_its_traceback_above_the_line():
    """A failure that is no user error is a bug: the traceback the rank recorded is printed, under
    its rank, above the one line that points at it (the launcher's own loggers are cut off)."""
    stack = 'Traceback (most recent call last):\n  File "mop/build.py", line 1\nTypeError: boom\n'
    bug = failure(1, {"message": "TypeError: boom", "extraInfo": {"py_callstack": stack, "timestamp": "0"}})
    code, text = failed_launch({0: bug, 1: failure(128 + signal.SIGTERM)})
    assert code == 1
    assert text == f"[rank 0] {stack}mop: error: rank(s) 0 failed; their tracebacks are above"


# The second node's ranks stop in step 5, after two checkpoints, each leaving its pid to be killed.
SECOND_NODE_STOPS_IN_STEP_5 = """
    import os, time
    from pathlib import Path
    import mop.train
    run_step, calls = mop.train.train_step, []
    def train_step(run, batches, *rest):
        calls.append(1)
        if len(calls) == 5 and os.environ["GROUP_RANK"] == "1":
            (Path(__file__).parent / f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
            time.sleep(600)
        return run_step(run, batches, *rest)
    mop.train.train_step = train_step
"""


def torchrun_node(run_dir: Path, port: int) -> subprocess.Popen:
    """One of two torchrun agents (2 ranks each) of a run, in its own session: the multi-node command of
    docs/multi-node-and-gpus.md on this machine, with the fault above injected."""
    hooks = run_dir.parent / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(SECOND_NODE_STOPS_IN_STEP_5))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=mop-test", "-m", "mop.cli", "train", *TINY_RUN,
           "--parallel.strategy=mop", f"--train.steps={STEPS}", "--checkpoint.every=2", "--checkpoint.keep=5",
           f"--log.run_dir={run_dir}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_a_node_lost_under_torchrun_is_said_once_by_the_node_that_goes_on(tmp_path):
    """Two torchrun agents of 2 ranks each, one killed whole mid-run: the other node's ranks stop, its
    first rank saying what was lost, where, and how to resume; the run resumes from the newest
    checkpoint and continues the single-process curve."""
    run_dir, port = tmp_path / "run", free_port()
    agents = [torchrun_node(run_dir, port) for _ in range(2)]
    pids = [tmp_path / "hooks" / f"rank-{rank}.pid" for rank in (2, 3)]
    try:
        wait_for(lambda: all(p.is_file() for p in pids), "the second node's step 5", agents[0])
        lost = next(a for a in agents if a.pid == _parent_of(int(pids[0].read_text())))
        os.killpg(lost.pid, signal.SIGKILL)  # the agent, then its ranks: the whole node
        for pid in pids:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        code, err = finish(next(a for a in agents if a is not lost))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    said = [line for line in err if line.startswith("mop: ")]
    assert checkpoints(run_dir) == ["step_2", "step_4"]
    assert code != 0 and len(said) == 1, err
    assert re.fullmatch(r"mop: error: lost a rank of another node \(ranks (0-1|2-3)\), which stopped \(see its node's log\): "
                        r"\w+ over the \w+ group \(in \w+\.py:\d+ \w+\) lost its connection to [\d.]+:\d+; this node's "
                        rf"ranks (0-1|2-3) stop too; the newest complete checkpoint is {re.escape(str(run_dir))}/"
                        r"checkpoints/step_4: resume with the same command and --checkpoint\.resume=latest "
                        rf"--log\.run_dir={re.escape(str(run_dir))}", said[0]), said[0]
    reference = tmp_path / "reference"
    assert main(["train", *ONE_PROCESS, f"--log.run_dir={reference}"]) == 0
    assert losses(run_dir)[:4] == pytest.approx(losses(reference)[:4], rel=1e-4)
    assert resume_in_one_process(run_dir, "step_4") == pytest.approx(losses(reference)[4:], rel=1e-4)


def _parent_of(pid: int) -> int:
    """The pid of process `pid`'s parent (a launched rank's: its agent)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
