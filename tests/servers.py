"""Helper servers for the tests (the stand-in engine, a real vLLM): a free port, and a wait for a server
that ends when it answers or when its process has exited, never after a fixed time."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

START_LIMIT_S = 900.0
"""How long a server may take to answer while its process lives: vLLM's CPU build loads a tiny model in
15-30 s on an idle 2-core machine and 140-210 s on a busy one; past this something is wrong."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(port: int, process, log: Path | None = None, path: str | None = None) -> None:
    """Return once the server on `port` answers (a connection, or with `path` a 200 to GET `path`); fail at
    once, with the tail of `log`, if `process` (a `subprocess.Popen` or `multiprocessing.Process`) exits
    first."""
    deadline = time.monotonic() + START_LIMIT_S
    while not _answers(port, path):
        if _exited(process):
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.is_file() else ""
            raise RuntimeError(f"the server for port {port} exited before answering:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server for port {port} did not answer within {START_LIMIT_S:.0f} s")
        time.sleep(0.2)


def _answers(port: int, path: str | None) -> bool:
    try:
        if path is None:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _exited(process) -> bool:
    return process.poll() is not None if hasattr(process, "poll") else not process.is_alive()
