"""`mop.profiling`: a profiled step's ops fall in the phase of the scope they ran in, and a backward
node in the phase of the forward op that made it (the trainer's own profiled steps: test_train)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from mop.profiling import event_phases, step_profile, split


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.Module()
        self.attention.core = torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.Linear(16, 16)

    def forward(self, x):
        return (self.mlp.experts(self.attention.core(x).relu()) * 2).sum()


def test_forward_ops_take_their_scope_and_backward_nodes_their_forward_ops_phase():
    model = Block()
    with step_profile(model, enabled=True) as profiled:
        model(torch.randn(8, 16, requires_grad=True)).backward()
    phases = {}
    for event, phase in event_phases(profiled._prof.events()):
        phases.setdefault(event.name, set()).add(phase)
    assert phases["aten::addmm"] == {"attention", "experts"}  # one linear in each scope
    assert phases["AddmmBackward0"] == {"attention", "experts"}
    for outside in ("aten::relu", "ReluBackward0", "aten::mul", "MulBackward0"):  # between the scopes
        assert phases[outside] == {"other"}, outside
    record = profiled.record(wall_s=10.0)
    assert record["time_attention_s"] > 0 and record["time_experts_s"] > 0 and record["time_attention_comm_s"] == 0
    assert not model.attention.core._forward_hooks and not model.mlp.experts._forward_pre_hooks  # removed after


def test_an_unprofiled_step_records_nothing():
    model = Block()
    with step_profile(model, enabled=False) as profiled:
        model(torch.randn(8, 16)).backward()
    assert profiled.record(wall_s=1.0) == {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pass
    assert split(prof.events()) == ({}, {})
