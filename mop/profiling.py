"""Where a step's time goes: one step under torch.profiler, its time split into phases (`log.profile_step`).

Phases. While the step runs, forward hooks open a profiler scope around every attention core
(`*.attention.core`: the kernel, and under Ulysses its all-to-alls) and every expert layer
(`*.mlp.experts`: the expert GEMMs, and under expert parallelism the dispatch and combine
all-to-alls and LLEP's weight transfers), and the heads' loss methods run in a "vocabulary" scope
(the logits and, under the vocabulary ring, its shard hops). Checkpointed blocks recompute under
the same hooks. Every backward node takes the phase of the forward op that made it (the
profiler's sequence numbers link the two), so a phase is its forward, recomputation and backward.

Accounting, per rank, on the thread that runs the step: each op's own time (its time less its
children's) goes to the phase of its nearest enclosing scope (or "other": projections, norms,
routers, the embedding, FSDP2's gathers and reductions), and to that phase's "comm" part when the
op is a collective (`c10d::`, gloo, NCCL). What no op covers (Python between ops, and on the CPU
the waits for the host optimizer's worker, `optimizer_exposed_s`) is "untracked": the step's wall
time less the ops'. On CUDA these are host times: kernels run asynchronously, so a phase's time is
where the host waited or launched, not device time. The profiler adds overhead to the step it
records (about 10-20% on the CPU here): compare the phases' shares, not their seconds with
unprofiled steps.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("attention", "experts", "vocabulary", "other")
SCOPE = "mop/phase/"
_BACKWARD_NODE = "autograd::engine::evaluate_function"
_BACKWARD_SCOPE = 1  # `torch.autograd.RecordScope.BACKWARD_FUNCTION`: a backward node's own event
COLLECTIVE_PREFIXES = ("c10d::", "record_param_comms", "gloo:", "nccl:", "ProcessGroupGloo", "ProcessGroupNCCL")


def vocabulary_scope():
    """The scope the heads' loss methods run in (a no-op outside a profiled step)."""
    return record_function(SCOPE + "vocabulary")


class StepProfile:
    """The profiled step's phase split, once the step has run (`record`)."""

    def __init__(self, prof: profile | None):
        self._prof = prof

    def record(self, wall_s: float) -> dict[str, float]:
        """`time_<phase>_s` and `time_<phase>_comm_s` of this rank (empty when the step was not profiled)."""
        if self._prof is None:
            return {}
        own, comm = split(self._prof.events())
        out = {f"time_{p}_s": own.get(p, 0.0) for p in PHASES}
        out.update({f"time_{p}_comm_s": comm.get(p, 0.0) for p in PHASES})
        out["time_untracked_s"] = max(0.0, wall_s - sum(own.values()))
        return out


@contextmanager
def step_profile(model: nn.Module, enabled: bool):
    """Run the body under torch.profiler with the phase scopes when `enabled`; yields a `StepProfile`."""
    if not enabled:
        yield StepProfile(None)
        return
    handles = [_scope_hooks(module, phase) for name, module in model.named_modules()
               for phase in [_phase_of(name)] if phase is not None]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with profile(activities=activities) as prof:
            yield StepProfile(prof)
    finally:
        for pair in handles:
            for handle in pair:
                handle.remove()


def _phase_of(module_name: str) -> str | None:
    path = "." + module_name
    return "attention" if path.endswith(".attention.core") else "experts" if path.endswith(".mlp.experts") else None


def _scope_hooks(module: nn.Module, phase: str):
    scopes = []

    def enter(*_):
        scope = record_function(SCOPE + phase)
        scope.__enter__()
        scopes.append(scope)

    def leave(*_):
        scopes.pop().__exit__(None, None, None)

    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave)


def split(events) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of own op time per phase, and of it in collectives (`event_phases`)."""
    own, comm = {}, {}
    for e, phase in event_phases(events):
        seconds = e.self_cpu_time_total / 1e6
        own[phase] = own.get(phase, 0.0) + seconds
        if e.name.startswith(COLLECTIVE_PREFIXES):
            comm[phase] = comm.get(phase, 0.0) + seconds
    return own, comm


def event_phases(events) -> list:
    """(event, phase) of every CPU event on the threads that ran the step: the one with the most op
    time, and the autograd engine's (on CUDA the backward runs on a thread of its own)."""
    events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not events:
        return []
    busiest = max({e.thread for e in events}, key=lambda t: sum(e.self_cpu_time_total for e in events if e.thread == t))
    threads = {busiest} | {e.thread for e in events if e.name.startswith(_BACKWARD_NODE)}
    forward_phase = {}
    for e in events:  # forward ops (recomputed ones too; not backward nodes) inside a scope
        if e.sequence_nr >= 0 and e.scope != _BACKWARD_SCOPE and not e.name.startswith(_BACKWARD_NODE):
            phase = _enclosing(e, None)
            if phase is not None:
                forward_phase[(e.thread, e.sequence_nr)] = phase
    return [(e, _enclosing(e, forward_phase) or "other") for e in events if e.thread in threads]


def _enclosing(event, forward_phase: dict | None) -> str | None:
    """The phase of the nearest scope around `event`, or of the forward op behind the backward node
    around it (with `forward_phase`)."""
    node = event
    while node is not None:
        if node.name.startswith(SCOPE):
            return node.name[len(SCOPE):]
        if forward_phase is not None and node.name.startswith(_BACKWARD_NODE):
            return forward_phase.get((node.fwd_thread, node.sequence_nr))
        node = node.cpu_parent
    return None
