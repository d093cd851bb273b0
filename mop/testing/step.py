"""One rank's training step, built and run as `mop train` does, with its memory measured: what
`mop bench e2e` times and compares, and what `tests/test_plan.py` holds the memory model against.

`Trainer` builds the run (`mop.build.build_run`) on fixed batches and steps it with the trainer's
own functions; `step_memory` takes a warm-up step and a memory step and reports the persistent
state by place and the step's transient device peak (`mop.testing.memory.PeakMemory`), less what
a GPU machine keeps in host memory (offloaded block inputs, offloaded or handed-over gradients).
"""

from __future__ import annotations

import statistics
import time
import weakref
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from mop.build import TrainingRun, build_run
from mop.config import load_config
from mop.parallel import DistLayout, Layout
from mop.runtime import Runtime, set_host_heap
from mop.settle import settle
from mop.testing.memory import PeakMemory
from mop.train import resume, train_step, update


def rank_batches(run: TrainingRun, documents: str) -> list[dict]:
    """This rank's micro-batches of one step: the shipped corpus packed and split as `mop train`
    does it (`TrainingRun.next_batches`). "single": the same tokens as one document per row (no
    document ids, positions across the whole row)."""
    d, sequence = run.config.data, run.config.parallel.sequence
    batches = run.next_batches()
    if documents == "single":
        tokens = d.seq_len // sequence
        first = run.runtime.rank % sequence * tokens
        for batch in batches:
            batch["document_ids"] = None
            batch["position_ids"] = torch.arange(first, first + tokens).expand_as(batch["input_ids"])
    return batches


class HostGradients:
    """Bytes of the gradient shards FSDP2's CPUOffloadPolicy has moved to the host, counted per storage.

    FSDP2 assigns a shard's gradient after its unit's reduce-scatter, then calls the parameter's
    post-accumulate-grad hooks. On a CPU-only machine the "host copy" is the reduce-scatter
    output itself, which the memory tracker would otherwise count as device memory.
    """

    def __init__(self, model: torch.nn.Module):
        self.live_bytes = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()
        for param in model.parameters():
            if isinstance(param, DTensor):
                param.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: torch.Tensor) -> None:
        storage = param.grad.to_local().untyped_storage()
        if storage not in self._seen:
            self._seen.add(storage)
            self.live_bytes += storage.nbytes()
            weakref.finalize(storage, self._release, storage.nbytes())

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


class Trainer:
    """One rank's training run (`build_run`, as `mop train` builds it) on fixed batches;
    `backward()` then `update()` is one optimizer step of the trainer's own functions."""

    def __init__(self, config, rank: int, documents: str):
        p = config.parallel  # the world is parallel.nproc ranks (WORLD in this benchmark)
        set_host_heap(config)  # as `mop train`'s ranks set theirs
        layout = DistLayout(Layout(p.nproc, p.sequence, p.expert, p.vocab), torch.device("cpu"))
        self.run = build_run(config, Runtime(rank, p.nproc, layout.device, layout))
        self.offload_store = self.run.offload_store
        self.host_gradients = HostGradients(self.run.model) if p.fsdp_cpu_offload else None
        self.optimizer_on_device = not (config.optim.offload or p.fsdp_cpu_offload)
        # the weights of checkpoint.init, if set, and what the objective needs before step 0, as `mop train`
        # starts (`resume`; not in a step's time, `prepare_s` says how long it took): a DPO or RL run's
        # precomputed reference log-probs (dpo.reference_dir, or rl.reference_dir: the ranks' shared
        # folder; the caller sets it)
        start = time.perf_counter()
        resume(self.run, Path(config.dpo.reference_dir))
        self.prepare_s = time.perf_counter() - start
        self.batches = rank_batches(self.run, documents)
        self.record: dict = {}
        """The last step's record (`train_step`'s: its loss and terms)."""

    def backward(self) -> None:
        self.run.optimizer.begin_step(self.run.config.optim.lr)  # constant: every step does the same work
        self.record = train_step(self.run, self.batches)

    def update(self) -> None:
        update(self.run)

    def step(self) -> None:
        self.backward()
        self.update()

    def host_bytes_now(self) -> int:
        """What the step holds in host memory right now: offloaded block inputs, offloaded gradients,
        and the gradients the host optimizer holds as handed over (a GPU copies them to the host)."""
        return ((self.offload_store.live_bytes if self.offload_store else 0)
                + (self.host_gradients.live_bytes if self.host_gradients else 0)
                + self.run.optimizer.held_gradient_bytes())

    def persistent_state(self) -> dict:
        """Bytes of the state that outlives a step, by category, on the device and on the host
        (`TrainingRun.state_bytes`; gradients are counted in the step's transient peak)."""
        state = self.run.state_bytes()
        per_param = sum(state[f"device_bytes_per_param_{k}"] for k in ("weights", "gradients", "optimizer"))
        return {"parameters": state["device_weights_bytes"], "optimizer_state": state["device_optimizer_bytes"],
                "host_parameters": state["host_weights_bytes"], "host_optimizer_state": state["host_optimizer_bytes"],
                "device_bytes_per_param": per_param}

    def step_peak(self) -> tuple[int, int]:
        """One step: (its transient device peak, the device bytes of the gradients its backward left)."""
        with PeakMemory(torch.device("cpu"), exclude=self.host_bytes_now) as memory:
            self.backward()
            gradients = 0 if self.host_gradients else _local_bytes(
                p.grad for p in self.run.model.parameters() if p.grad is not None)
            if self.optimizer_on_device:
                self.update()
        if not self.optimizer_on_device:
            self.update()
        return memory.peak_bytes, gradients


def step_memory(trainer: Trainer) -> dict:
    """A warm-up step, then a memory step: this rank's per-rank device memory (persistent state plus
    the step's transient peak, "device") and its parts."""
    trainer.step()
    state = trainer.persistent_state()
    peak, gradients = trainer.step_peak()
    store = trainer.offload_store
    return {**state, "step_peak": peak, "gradients": gradients,
            "device": state["parameters"] + state["optimizer_state"] + peak,
            "host_activations": store.peak_bytes if store else 0}


def timed_steps(rank: int, world: int, overrides: list[str], steps: int) -> dict:
    """A benchmark's rank (one intra-op thread): the run `mop train` would build from `overrides` on
    `world` ranks, its memory (`step_memory`) and the median time of `steps` more steps."""
    torch.set_num_threads(1)
    trainer = Trainer(settle(load_config(None, overrides), world, fit_memory=False), rank, "packed")
    memory = step_memory(trainer)  # a warm-up step, then the memory step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    return {**memory, "step_s": statistics.median(times)}
