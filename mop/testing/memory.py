"""Peak memory of the tensors a piece of code creates, on CPU as on CUDA.

On CUDA the caching allocator's peak (`max_memory_allocated`) above what was allocated at entry.
On CPU there is no allocator to ask, so a dispatch mode sees every tensor an operator returns,
counts each new storage once while it lives (freed storages are subtracted by a finalizer) and
keeps the running peak. Storages that exist at entry (parameters, inputs, pre-allocated
gradients; found by scanning the live objects once) are not counted, even when an in-place or
view operator returns them: the number is the transient footprint of the code in the block.
Except one kind: a storage that is empty at entry and grows in place. FSDP2 frees a unit's
unsharded parameters by resizing their storage to zero after use and resizes them back before
its next all-gather, so the gathered weights live in storages that exist at entry; their
current sizes are added to the live bytes after every operator.

`exclude` subtracts bytes that live elsewhere on a real machine (the host copies made by
activation offload): on CPU they are allocated in the same memory, on CUDA they never are.
"""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveStorages(TorchDispatchMode):
    def __init__(self, exclude: Callable[[], int]):
        super().__init__()
        self.exclude = exclude
        self.live = 0
        self.peak = 0
        self.allocated = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._known: weakref.WeakSet = weakref.WeakSet()
        self._resizable: weakref.WeakSet = weakref.WeakSet()  # empty at entry: FSDP2's unsharded parameters

    def remember_existing(self) -> None:
        # type() rather than isinstance(): the latter reads __class__, which some deprecated torch
        # module attributes answer with a warning. Tensor subclasses (DTensor) are skipped: their
        # local tensors are live objects of their own.
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                self._known.add(storage)
                if storage.nbytes() == 0:
                    self._resizable.add(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._track(tensor.untyped_storage())
        self.peak = max(self.peak, self._now())
        return out

    def _now(self) -> int:
        return self.live + sum(storage.nbytes() for storage in self._resizable) - self.exclude()

    def _track(self, storage) -> None:
        if storage in self._seen or storage in self._known or storage.nbytes() == 0:
            return
        self._seen.add(storage)
        self.allocated += storage.nbytes()
        self.live += storage.nbytes()
        weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then `m.peak_bytes`, and `m.allocated_bytes`: the total of
    every allocation in the block, a proxy for memory traffic that a peak does not show."""

    def __init__(self, device: torch.device, exclude: Callable[[], int] = lambda: 0):
        self.device = device
        self.exclude = exclude
        self.peak_bytes = 0
        self.allocated_bytes = 0
        self._mode = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._allocated_start = torch.cuda.memory_stats(self.device).get("allocated_bytes.all.allocated", 0)
        else:
            self._mode = _LiveStorages(self.exclude)
            self._mode.remember_existing()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is None:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.allocated_bytes = (torch.cuda.memory_stats(self.device).get("allocated_bytes.all.allocated", 0)
                                    - self._allocated_start)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
            self.allocated_bytes = self._mode.allocated


def preallocate_grads(module: torch.nn.Module) -> None:
    """Give every parameter a zero gradient: later gradients accumulate into it in place, so a
    measurement sees the step's transient memory rather than the first allocation of `.grad`."""
    for param in module.parameters():
        param.grad = torch.zeros_like(param)


def measure_step(step: Callable[[], None], repeats: int, exclude: Callable[[], int] = lambda: 0) -> dict:
    """Run `step` once to warm up, once under `PeakMemory` (CPU), then `repeats` times for the mean time."""
    step()
    with PeakMemory(torch.device("cpu"), exclude) as memory:
        step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return {"peak_bytes": memory.peak_bytes, "seconds": (time.perf_counter() - start) / repeats}


class ResidentGrowth:
    """How much this process's peak resident size grows inside the block, in bytes (Linux): the peak
    (VmHWM) is reset to the current size on entry (`/proc/self/clear_refs`), so an earlier peak of
    the process does not count."""

    def __enter__(self) -> "ResidentGrowth":
        Path("/proc/self/clear_refs").write_text("5")
        self._before = _status_kib("VmRSS")
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = (_status_kib("VmHWM") - self._before) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
