"""What a run does when something outside the model goes wrong, and the one line it says.

Stop requests (preemption). A scheduler ends a job with SIGTERM (Slurm: `--signal=TERM@<s>`
before the time limit), a user with Ctrl-C (SIGINT). `StopRequest` catches both in every rank
and only records them; at the end of each step the ranks agree on it (one all-reduce MAX of the
signal number over the world group, so a signal seen by any rank stops all of them after the
same step), save a checkpoint (atomically, as every save) and raise `Stopped`, whose message
says how to resume; the process exits with 128 + the signal number, as a process killed by that
signal would. A signal that arrives while ranks are already failing (the launcher stops the
others when one dies) changes nothing: a rank whose collective then fails exits quietly
(`quiet_exit_code`), and the launcher names the rank that failed first.

Hung collectives. Every process group gets `parallel.timeout_s` (`mop.parallel.mesh`). On gloo a
collective that waits longer raises an error that names neither the operation nor the group;
`collective_timeout` finds both in the traceback (the innermost `torch.distributed` call and its
group's description) and says them in one line. On NCCL the watchdog aborts the process
(SIGABRT) after logging the operation and the group; `killed_by_signal` names that cause.

Ranks killed by a signal: `launch_failure` says which rank, which signal and its likely cause.
"""

from __future__ import annotations

import signal
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PEER_LOST = 4  # exit code of a rank whose collective failed because another rank had already stopped


class StopRequest:
    """Records SIGTERM / SIGINT (the first one) while training; a context manager that restores
    the previous handlers on exit. Outside the main thread (signals go to the main thread) it
    records nothing."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        # The launcher forwards the signal it got, so a rank may see the same stop twice.
        self.signal = self.signal or signum

    def agreed(self, group: dist.ProcessGroup | None, device: torch.device) -> int | None:
        """The signal that stops the run after this step, if any rank got one (collective over `group`)."""
        seen = self.signal or 0
        if group is not None:
            flag = torch.tensor([seen], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            seen = int(flag.item())
        return seen or None


@dataclass
class Stopped(Exception):
    """Training stopped on a signal after `step` steps, with checkpoint `saved`."""

    signum: int
    step: int
    steps: int
    saved: Path
    run_dir: Path

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after step {self.step} of {self.steps}; saved "
                f"{self.saved}; resume with the same command and --checkpoint.resume=latest "
                f"--log.run_dir={self.run_dir}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def quiet_exit_code(err: BaseException, stop: StopRequest) -> int | None:
    """The exit code of a rank that failed only because another one stopped first, else None.

    Either the launcher already asked this rank to stop (a peer failed, or the job is being
    ended), or its collective lost the connection to a peer; the launcher names the first failure."""
    if stop.signal is not None:
        return 128 + stop.signal
    if isinstance(err, RuntimeError) and "Connection closed by peer" in str(err):
        return PEER_LOST
    return None


# A collective that waited past the group's timeout: gloo's message, NCCL's when it raises.
_TIMEOUT_MARKS = ("Timed out waiting", "Watchdog caught collective operation timeout")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than `parallel.timeout_s`; the message names the operation and group."""


def collective_timeout(err: BaseException) -> CollectiveTimeout | None:
    """The one-line error naming the operation and the group of a collective that timed out, else None."""
    if not any(mark in str(err) for mark in _TIMEOUT_MARKS):
        return None
    operation, group, caller = "an asynchronous collective's wait", "", ""
    for frame, line in traceback.walk_tb(err.__traceback__):
        where = frame.f_code.co_filename
        if where.endswith("distributed_c10d.py") and isinstance(frame.f_locals.get("group"), dist.ProcessGroup):
            operation, group = frame.f_code.co_name, _group_name(frame.f_locals["group"])
        elif "/torch/" not in where:  # the innermost caller outside torch
            caller = f"{Path(where).name}:{line} {frame.f_code.co_name}"
    over = f" over the {group} group" if group else ""
    return CollectiveTimeout(f"parallel.timeout_s: {operation}{over} waited longer than the timeout (in {caller}); "
                             "another rank stopped or is stuck (see its message); raise --parallel.timeout_s if a "
                             "step legitimately takes longer")


def _group_name(group: dist.ProcessGroup) -> str:
    """The layout's name for a group: DeviceMesh describes its groups as mesh_<dim>."""
    described = getattr(group, "group_desc", "") or ""
    return {"default_pg": "world"}.get(described, described.removeprefix("mesh_"))


# The likely cause of a rank killed by a signal, and what to do about it.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "usually the out-of-memory killer (host memory): lower train.memory_budget (the layout is "
                    "fitted to it) or data.seq_len, or set train.activation_checkpointing=full and raise "
                    "parallel.sequence / parallel.attention_head_chunks / parallel.llep_chunks",
    signal.SIGABRT: "an abort in native code; on GPUs usually NCCL's watchdog after a collective outlived "
                    "parallel.timeout_s (its log line above names the operation and group): raise the timeout if a "
                    "step legitimately takes longer",
    signal.SIGSEGV: "a crash in native code (a bug: please report it with the rank's log)",
    signal.SIGBUS: "a shared-memory fault, usually /dev/shm too small: give the container more (docker --shm-size)",
    signal.SIGTERM: "stopped from outside (a scheduler or a user) before it could save",
    signal.SIGINT: "stopped from outside (a scheduler or a user) before it could save",
}


def secondary(failure) -> bool:
    """A rank that failed only because another one had (see `quiet_exit_code`), or that the
    launcher stopped; `failure` is torch elastic's ProcessFailure."""
    return failure.exitcode in (PEER_LOST, -signal.SIGTERM, *(128 + sig for sig in STOP_SIGNALS))


def recorded_error(failure, kinds: tuple[type, ...]) -> str | None:
    """The one-line message of an error of one of `kinds` that a rank recorded for the launcher
    (torch elastic's error file: "<type name>: <message>"), else None."""
    recorded = failure.message  # ErrorHandler's record: {"message": "<type>: <text>", "extraInfo": ...}
    recorded = recorded.get("message", "") if isinstance(recorded, dict) else recorded
    kind, _, message = (recorded if isinstance(recorded, str) else "").partition(": ")
    return message if kind in {k.__name__ for k in kinds} else None


def launch_failure(failures: dict) -> str:
    """One line on why launched ranks failed (`failures`: rank -> torch elastic's ProcessFailure):
    the ranks that failed first (not `secondary`), a rank killed by a signal with its likely cause."""
    causes = {rank: f for rank, f in failures.items() if not secondary(f)} or failures
    killed = {rank: -f.exitcode for rank, f in causes.items() if f.exitcode < 0}
    if killed:
        signum = killed[min(killed)]
        cause = _SIGNAL_CAUSES.get(signum, "see the rank's log")
        return f"rank(s) {', '.join(map(str, sorted(killed)))} killed by {signal.Signals(signum).name}, {cause}"
    if all(f.exitcode == PEER_LOST for f in causes.values()):
        return "the ranks lost their connections to each other (a network failure or a killed process)"
    return f"rank(s) {', '.join(map(str, sorted(causes)))} failed; their tracebacks are above"
