"""`train.keep_freed_host_memory` (issue 50): a rank's host heap keeps what it frees, so the next
activation of that size reuses its pages instead of faulting fresh ones in; without it, glibc hands
a large block back to the kernel as soon as it is freed."""

import subprocess
import sys

import pytest

FREE_AND_MEASURE = """
import sys, torch
from mop.runtime import keep_freed_host_memory
kept = sys.argv[1] == "keep" and keep_freed_host_memory()
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = resident()
block = torch.ones(64 * 2**20)  # 256 MiB, written so its pages are resident
held = resident() - before
del block
print(kept, held, resident() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
@pytest.mark.parametrize("mode", ["keep", "default"])
def test_a_freed_block_stays_in_the_heap_only_when_kept(mode):
    out = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode], capture_output=True, text=True, check=True)
    kept, held, after_free = out.stdout.split()
    assert kept == str(mode == "keep")
    assert int(held) >= 250 * 2**20
    if mode == "keep":
        assert int(after_free) >= 250 * 2**20  # still the process's, for the next allocation
    else:
        assert int(after_free) < 16 * 2**20  # unmapped at the free
