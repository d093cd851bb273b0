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

import re
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

    Either its collective lost the connection to a peer (whatever signal the launcher sent once it
    saw that peer stop), or the launcher already asked this rank to stop (a peer failed, or the job
    is being ended); the launcher names the first failure."""
    if isinstance(err, RuntimeError) and "Connection closed by peer" in str(err):
        return PEER_LOST
    if stop.signal is not None:
        return 128 + stop.signal
    return None


# A collective that waited past the group's timeout: gloo's message, NCCL's when it raises.
_TIMEOUT_MARKS = ("Timed out waiting", "Watchdog caught collective operation timeout")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than `parallel.timeout_s`; the message names the operation and group."""


def collective_timeout(err: BaseException) -> CollectiveTimeout | None:
    """The one-line error naming the operation and the group of a collective that timed out, else None."""
    if not any(mark in str(err) for mark in _TIMEOUT_MARKS):
        return None
    what, caller = failed_collective(err)
    return CollectiveTimeout(f"parallel.timeout_s: {what} waited longer than the timeout (in {caller}); another rank "
                             "stopped or is stuck (see its message); raise --parallel.timeout_s if a step legitimately "
                             "takes longer")


def failed_collective(err: BaseException) -> tuple[str, str]:
    """Which collective `err` came out of, as its traceback tells: the innermost `torch.distributed`
    call and its group's name, and the innermost caller outside torch."""
    operation, group, caller = "an asynchronous collective's wait", "", ""
    for frame, line in traceback.walk_tb(err.__traceback__):
        where = frame.f_code.co_filename
        if where.endswith("distributed_c10d.py") and isinstance(frame.f_locals.get("group"), dist.ProcessGroup):
            operation, group = frame.f_code.co_name, _group_name(frame.f_locals["group"])
        elif "/torch/" not in where:  # the innermost caller outside torch
            caller = f"{Path(where).name}:{line} {frame.f_code.co_name}"
    over = f" over the {group} group" if group else ""
    return f"{operation}{over}", caller


@dataclass
class PeerLost(Exception):
    """A collective lost its connection to a rank that had stopped. mop's launcher names that rank
    itself; under torchrun the first rank of each node that goes on says this (`mop.train.train`),
    once for its node, whose agent cannot tell: what was lost as far as this rank can tell (the
    peer's address; with the node's ranks known, the other nodes'), in which collective, and how to
    continue."""

    collective: str
    peer: str
    node_ranks: range
    world: int
    newest: Path | None
    run_dir: Path

    exit_code = PEER_LOST

    @classmethod
    def of(cls, err: BaseException, env, newest: Path | None, run_dir: Path) -> PeerLost:
        """From the error and the torchrun place (`mop.parallel.mesh.TorchrunEnv`) of the rank it reached."""
        peer = re.search(r"Connection closed by peer \[([^\]]*)\]:(\d+)", str(err))
        first = env.rank - env.local_rank
        what, caller = failed_collective(err)
        return cls(f"{what} (in {caller})", f"{peer[1]}:{peer[2]}" if peer else "a peer",
                   range(first, first + env.local_world_size), env.world_size, newest, run_dir)

    def __str__(self) -> str:
        others = [r for r in range(self.world) if r not in self.node_ranks]
        lost = f"a rank of another node (ranks {_ranks(others)})" if others else "a rank of this node"
        resume = (f"the newest complete checkpoint is {self.newest}: resume with the same command and "
                  f"--checkpoint.resume=latest --log.run_dir={self.run_dir}" if self.newest else
                  f"no checkpoint is complete in {self.run_dir}: the same command starts the run again")
        return (f"lost {lost}, which stopped (see its node's log): {self.collective} lost its connection to "
                f"{self.peer}; this node's ranks {_ranks(self.node_ranks)} stop too; {resume}")


def _ranks(ranks) -> str:
    """`[0, 1, 2, 5]` as "0-2, 5"."""
    runs, ranks = [], sorted(ranks)
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


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
