"""Run a function on W spawned ranks (gloo on CPU, NCCL on CUDA) and collect what each returns; never hang.

Algorithm. The parent hosts the job's TCP store on a localhost port the kernel picks as the store
binds it (as torchrun's agent does: the ranks join it as clients, ``TORCHELASTIC_USE_AGENT_STORE``; a
port chosen first and bound later by rank 0 could be taken in between by another test's connection),
pickles ``(fn, args, kwargs)`` once, and starts one process per rank as a fork of a fork server that has already imported torch and mop's training
stack (`FORK_SERVER_MODULES`). As with 'spawn', children share no state with the parent and get its
sys.path and working directory; their environment is the fork server's (the parent's at the first
call). Each child sets the torchrun variables for itself and joins through
``mop.parallel.init_distributed`` (the trainer's own path: on ``device="cpu"`` gloo; on
``device="cuda"`` NCCL with rank r on GPU r, so W GPUs are needed, ``cuda_ranks_available``), with
one intra-op thread and seed 0 on every rank (tests build full tensors from one seed, then shard, as
the stack does). It meets the others in a barrier, calls ``fn(rank, world_size, *args, **kwargs)``,
meets the others in a barrier again, destroys the group, and writes ``("ok", value)`` or ``("error",
traceback)`` to its own result file. The parent waits on the process sentinels until every rank has
exited, a rank has failed, or ``timeout`` expires.

Invariants:
- The call returns only when every child is gone: stragglers are killed before it returns or
  raises, and the temporary directory is removed.
- A failure is reported with each failing rank's number and full traceback, in the order the
  parent saw the ranks exit: the root cause comes first, as the ranks that fail later usually
  fail only because it closed its sockets.
- A timeout names the ranks still running and the ranks that finished, so a collective that some
  rank never entered is identifiable.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What the fork server imports before it forks any rank: importing them runs no torch op and starts
# no thread (tests/test_collectives.py checks it), so a fork of it is as clean as a fresh process.
FORK_SERVER_MODULES = ("torch", "torch.distributed", "mop.train", "mop.testing.step")
# After one rank fails, the others get this long to fail or finish on their own before they are
# killed: peers of the failed rank error out at once (closed sockets), but ranks blocked in a
# collective that does not involve it would otherwise wait for the whole timeout.
_GRACE_S = 3.0


class DistributedError(RuntimeError):
    """One or more ranks raised, or died without reporting a result. `killed`: the ranks a signal
    ended (the kernel's out-of-memory killer sends SIGKILL), with the signal's number."""

    def __init__(self, message: str, killed: dict[int, int] | None = None):
        super().__init__(message)
        self.killed = killed or {}


def cuda_ranks_available(world_size: int) -> bool:
    """Whether ``world_size`` NCCL ranks can run here: NCCL takes one GPU per rank."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def rank_device():
    """The device of the calling rank (inside ``fn``): its GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, device: str = "cpu", **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks of ``device`` ("cpu":
    gloo; "cuda": NCCL, one GPU per rank; ``fn`` finds its device with ``rank_device()``).

    ``fn`` must be a module-level function and its arguments and return value picklable.
    Returns the per-rank return values in rank order. Raises ``DistributedError`` when a rank
    fails and ``TimeoutError`` when the ranks do not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device == "cuda" and not cuda_ranks_available(world_size):
        raise ValueError(f"{world_size} CUDA ranks need {world_size} GPUs (NCCL runs one rank per GPU)")
    # Pickle here so an unpicklable fn (a lambda, a closure) fails in the caller, not in W children.
    payload = pickle.dumps((fn, args, kwargs))
    ctx = mp.get_context("forkserver")
    # The fork server imports torch and mop's training stack once per test session; each rank is
    # then a fork of it (~0.05 s) instead of importing them itself (~1.8 s of DTensor, DCP and
    # mop per call). Forking is safe there because that process has run no torch ops and started
    # no thread (`FORK_SERVER_MODULES`).
    ctx.set_forkserver_preload(list(FORK_SERVER_MODULES))
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="mop-dist-") as tmp:
        paths = [Path(tmp) / f"rank{rank}.pkl" for rank in range(world_size)]
        procs = [
            ctx.Process(target=_child, args=(rank, world_size, store.port, payload, str(paths[rank]), device),
                        daemon=True)
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            exit_order = _wait(procs, timeout)
        finally:
            started = [p for p in procs if p.pid is not None]  # start() itself may have raised
            for p in started:
                if p.exitcode is None:
                    p.kill()
            for p in started:
                p.join()
        outcomes = {rank: _read(paths[rank]) for rank in exit_order}

    running = [rank for rank in range(world_size) if rank not in exit_order]
    failures = []
    for rank, outcome in outcomes.items():
        code = procs[rank].exitcode
        if outcome is None:
            failures.append(f"rank {rank} exited with code {code} without reporting a result")
        elif outcome[0] != "ok":
            failures.append(f"rank {rank} raised:\n{outcome[1]}")
        elif code != 0:
            failures.append(f"rank {rank} returned but then exited with code {code}")
    if failures:
        parts = list(failures)
        if running:
            parts.append(f"ranks {running} were still running and were killed")
        killed = {rank: -procs[rank].exitcode for rank in outcomes if (procs[rank].exitcode or 0) < 0}
        raise DistributedError(f"{len(failures)} of {world_size} ranks failed\n\n" + "\n".join(parts), killed)
    if running:
        finished = sorted(exit_order)
        raise TimeoutError(
            f"distributed run timed out after {timeout:g}s: ranks {running} were still running "
            f"(finished: {finished}); likely a collective that some rank never entered"
        )
    return [outcomes[rank][1] for rank in range(world_size)]


def _wait(procs: list[mp.process.BaseProcess], timeout: float) -> list[int]:
    """Wait for the ranks; returns the ranks that exited, in exit order."""
    deadline = time.monotonic() + timeout
    exit_order: list[int] = []
    failed_at: float | None = None
    while len(exit_order) < len(procs):
        limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        alive = [p.sentinel for rank, p in enumerate(procs) if rank not in exit_order]
        multiprocessing.connection.wait(alive, timeout=remaining)
        for rank, p in enumerate(procs):
            if rank not in exit_order and p.exitcode is not None:
                exit_order.append(rank)
                if p.exitcode != 0 and failed_at is None:
                    failed_at = time.monotonic()
    return exit_order


def _read(path: Path) -> tuple[str, Any] | None:
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _write(path: str, outcome: tuple[str, Any]) -> None:
    # Write then rename, so the parent never reads a half-written file from a rank killed mid-write.
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)


def _child(rank: int, world_size: int, port: int, payload: bytes, path: str, device: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from mop.parallel.mesh import init_distributed

    torch.set_num_threads(1)  # W ranks share a few cores; tiny test tensors gain nothing from more
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent's store: every rank is its client
    )
    try:
        # Unpickled inside the try so an import error in fn's module is reported like any other.
        fn, args, kwargs = pickle.loads(payload)
        init_distributed(torch.device("cuda", rank) if device == "cuda" else torch.device("cpu"))
        # Every rank is connected to every other before fn runs: a rank that dies early in fn
        # (the harness's own tests make one) must not break a peer still joining the group.
        dist.barrier()
        value = fn(rank, world_size, *args, **kwargs)
        # No rank tears its sockets down while a peer still waits on fn's last message.
        dist.barrier()
        dist.destroy_process_group()
        _write(path, ("ok", value))
    except BaseException:
        _write(path, ("error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter shutdown: it can block on gloo threads still waiting on peers.
        os._exit(1)
