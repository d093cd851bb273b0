"""The tests' wait for a helper server (`servers.wait_until_serving`): it returns once the server answers,
however long its start takes, and fails at once, with the server's log, when its process exits first;
it never waits a fixed time."""

import subprocess
import sys
import time

import pytest

from servers import free_port, wait_until_serving

# A server that listens only after a start-up that takes longer than a fixed wait of the old kind (200
# tries of 0.15 s at most) would allow on a busy machine, and answers one connection.
LATE_SERVER = """
import socket, sys, time
time.sleep(float(sys.argv[2]))
with socket.socket() as s:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    s.accept()[0].close()
"""


def test_a_server_that_starts_late_is_waited_for_until_it_answers():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", LATE_SERVER, str(port), "1.5"])
    try:
        start = time.monotonic()
        wait_until_serving(port, process)
        assert time.monotonic() - start >= 1.5
    finally:
        process.kill()
        process.wait()


def test_a_server_that_exits_before_answering_fails_the_wait_at_once_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                                   stdout=out, stderr=subprocess.STDOUT)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited before answering") as failure:
        wait_until_serving(free_port(), process, log)
    assert "no model here" in str(failure.value)
    assert time.monotonic() - start < 30  # the process's exit ends the wait, not START_LIMIT_S (900 s)
