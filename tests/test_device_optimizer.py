"""torch AdamW on the device over a `mop` layout, in the multi-tensor (foreach) form CUDA defaults to.

A foreach kernel takes one list of tensors per call: plain tensors, or DTensors of one mesh. Under
`mop` a rank holds the dense weights as DTensors of the world mesh, the expert partitions as
DTensors of their replica mesh and the vocabulary shard as a plain tensor, so every parameter
group must hold one kind only. On the CPU torch defaults to the per-tensor loop; the test asks for
foreach, as CUDA's default does, and checks the step against the per-tensor loop's.
"""

import pytest
import torch
from torch.testing import assert_close

from mop.build import build_run
from mop.config import load_config
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import forward_backward
from test_train import TINY

LAYOUT = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
          "--parallel.vocab=2", "--parallel.expert_balance=llep", "--optim.offload=false"]


def _kind(p) -> str:
    mesh = getattr(p, "device_mesh", None)
    return "plain" if mesh is None else f"mesh {mesh.mesh.tolist()}"


def _one_step(rank, world, run_dir, foreach: bool):
    config = settle(load_config(None, [*TINY, *LAYOUT, f"--log.run_dir={run_dir}"]), world, fit_memory=False)
    runtime = Runtime(rank, world, torch.device("cpu"), DistLayout(Layout(world, 2, 2, 2), torch.device("cpu")))
    run = build_run(config, runtime)
    groups = run.optimizer.adamw.param_groups
    kinds = [sorted({_kind(p) for p in group["params"]}) for group in groups]
    for group in groups:
        group["foreach"] = foreach
    forward_backward(run.model, run.next_batches(), NextTokenLoss(run.model, 100, config.train.global_batch),
                     runtime, run.autocast())
    run.optimizer.step(config.train.grad_clip)
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for name, p in run.model.named_parameters()}
    return kinds, local


@pytest.mark.slow
def test_foreach_adamw_steps_like_the_per_tensor_loop_on_every_kind_of_shard(tmp_path):
    looped = run_distributed(_one_step, 2, str(tmp_path / "loop"), False)
    fused = run_distributed(_one_step, 2, str(tmp_path / "foreach"), True)
    for rank, ((kinds, loop_params), (_, foreach_params)) in enumerate(zip(looped, fused)):
        assert all(len(kind) == 1 for kind in kinds), f"a parameter group mixes kinds of shard: {kinds}"
        # The dense weights (world mesh), the expert partition (its replica group: this rank alone at
        # W = Ep = 2) and the vocabulary shard (plain).
        assert {k for kind in kinds for k in kind} == {"mesh [0, 1]", f"mesh [{rank}]", "plain"}
        for name, value in loop_params.items():
            assert_close(foreach_params[name], value, atol=1e-6, rtol=1e-6, msg=name)
