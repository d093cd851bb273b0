"""Per-layer code reads the device back at most once per MoE layer: the expert counts its routing
(and LLEP's plan) is computed from on the host. On CUDA every other host read, and every operator
whose output size depends on the device's data (bincount, nonzero, boolean indexing, ...), would
stall the CPU until the GPU catches up, in every layer.

The CPU cannot show a stall, so the test counts what would cause one on CUDA: each host read of a
tensor (`item`, `int`, `bool`, `tolist`) and each operator of `DATA_DEPENDENT`, inside every block's
forward and in the whole backward (a checkpointed block's recomputation included), over one step
of the reference and of the full `mop` layout on 2 gloo ranks. Per-micro-batch work outside the
blocks (the document boundaries, the target count) is not per-layer code and is not counted.
"""

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mop.build import build_run
from mop.config import load_config
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import forward_backward
from test_train import TINY

aten = torch.ops.aten
# Operators that wait for the device on CUDA: their output's size (or value) depends on its data.
DATA_DEPENDENT = {aten.bincount, aten.nonzero, aten.masked_select, aten.unique_consecutive, aten._unique,
                  aten._unique2, aten.unique_dim, aten.equal, aten.is_nonzero}


class HostSyncs(TorchDispatchMode):
    """Counts host reads and data-dependent operators while `counting` is set."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.reads: list[str] = []
        self.data_dependent: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            packet = func.overloadpacket
            if packet is aten._local_scalar_dense:
                self.reads.append(str(func))
            elif packet in DATA_DEPENDENT or _bool_index(func, args) or _unsized_repeat(func, args, kwargs):
                self.data_dependent.append(str(func))
        return func(*args, **kwargs)


def _bool_index(func, args) -> bool:
    return func.overloadpacket is aten.index and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def _unsized_repeat(func, args, kwargs) -> bool:
    return (func.overloadpacket is aten.repeat_interleave and isinstance(args[0], torch.Tensor)
            and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
            and kwargs.get("output_size") is None)


@contextmanager
def counted_in_blocks(model, syncs: HostSyncs, monkeypatch):
    """Count inside each block's forward; `tolist` (no operator on a CPU tensor) counted as a read."""
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        if syncs.counting:
            syncs.reads.append("tolist")
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    hooks = []
    for block in model.layers:
        hooks.append(block.register_forward_pre_hook(lambda *_: setattr(syncs, "counting", True)))
        hooks.append(block.register_forward_hook(lambda *_: setattr(syncs, "counting", False)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def syncs_of_one_step(config, runtime) -> dict:
    """Host reads and data-dependent operators per MoE layer pass of one step's micro-batches."""
    run = build_run(config, runtime)
    batches = run.next_batches()
    targets = sum(int((b["labels"] != -100).sum()) for b in batches) * runtime.world  # equal shares suffice here
    syncs = HostSyncs()
    with pytest.MonkeyPatch.context() as monkeypatch, counted_in_blocks(run.model, syncs, monkeypatch), syncs:
        original_backward = torch.Tensor.backward

        def counted_backward(tensor, *args, **kwargs):
            syncs.counting = True
            try:
                return original_backward(tensor, *args, **kwargs)
            finally:
                syncs.counting = False

        monkeypatch.setattr(torch.Tensor, "backward", counted_backward)
        objective = NextTokenLoss(run.model, targets, config.train.global_batch)
        forward_backward(run.model, batches, objective, runtime, run.autocast(), run.optimizer)
    run.optimizer.synchronize()
    passes = len(batches) * (config.model.layers - config.model.dense_layers)
    return {"reads_per_moe_layer": len(syncs.reads) / passes, "reads": sorted(set(syncs.reads)),
            "data_dependent": sorted(set(syncs.data_dependent))}


MOP = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
       "--parallel.vocab=2", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0",
       "--parallel.llep_min_chunk=4", "--optim.offload=true"]
VARIANTS = {"llep": [], "chunked-llep+ac+offload": ["--parallel.llep_chunks=2", "--train.activation_checkpointing=full",
                                                   "--train.offload_activations=true"]}


def _mop_syncs(rank, world, run_dir, extra):
    config = settle(load_config(None, [*TINY, *MOP, *extra, f"--log.run_dir={run_dir}"]), world, fit_memory=False)
    layout = DistLayout(Layout(world, 2, 2, 2), torch.device("cpu"))
    return syncs_of_one_step(config, Runtime(rank, world, torch.device("cpu"), layout))


def check(result: dict) -> None:
    assert result["data_dependent"] == [], f"operators that wait for the device: {result['data_dependent']}"
    assert result["reads_per_moe_layer"] <= 1, f"host reads per MoE layer pass: {result}"


def test_reference_reads_the_device_once_per_moe_layer(tmp_path):
    config = settle(load_config(None, [*TINY, f"--log.run_dir={tmp_path}"]), 1, fit_memory=False)
    result = syncs_of_one_step(config, Runtime(0, 1, torch.device("cpu"), None))
    check(result)
    assert result["reads"] == ["tolist"]  # the expert counts, for the grouped GEMM's groups


@pytest.mark.parametrize("variant", [pytest.param("llep", marks=pytest.mark.slow), "chunked-llep+ac+offload"])
def test_mop_layout_reads_the_device_once_per_moe_layer(tmp_path, variant):
    for result in run_distributed(_mop_syncs, 2, str(tmp_path), VARIANTS[variant]):
        check(result)
