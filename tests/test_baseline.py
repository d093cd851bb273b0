"""End to end: the fsdp2 baseline on 2 ranks against the reference, and the settings it refuses.

Runs go through the real command line, like `test_train.py`, whose tiny model, runner and
reference run these share.
"""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from mop.cli import main
from mop.config import load_config
from mop.models.transformer import build_model
from mop.parallel import DistLayout, Layout
from mop.parallel.baseline import parallelize_fsdp2
from mop.settle import settle
from mop.testing import run_distributed
from test_train import TINY, losses, reference, run  # noqa: F401  (reference: the shared fixture)

FSDP2 = ["--parallel.strategy=fsdp2", "--parallel.nproc=2"]


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("plain", []),
    ("expert", ["--parallel.expert=2"]),
    ("sequence", ["--parallel.sequence=2", "--train.activation_checkpointing=full"]),
    # Offload on the expert layout: both the dense and the expert units carry the policy.
    ("cpu-offload", ["--parallel.fsdp_cpu_offload=true", "--parallel.expert=2"]),
])
def test_fsdp2_matches_the_reference(tmp_path, reference, name, extra):
    records = run(tmp_path, name, *FSDP2, *extra)
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)
    if "--parallel.expert=2" in extra:  # the expert-parallel layers ran (they report their routing)
        assert all(r["rank_load_imbalance_before"] >= 1.0 for r in records)


def offloaded_parameters(rank, world, config):
    """(parameters FSDP2 offloads, all parameters) of this rank's fsdp2 model."""
    model = build_model(config.model, config.train.seed)
    p = config.parallel
    parallelize_fsdp2(model, DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu")), config)
    # FSDP2 has no public accessor for a unit's policy; each managed parameter records whether it is offloaded.
    managed = [param for module in model.modules() if isinstance(module, FSDPModule)
               for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params]
    return sum(param.offload_to_cpu for param in managed), len(list(model.parameters()))


def test_cpu_offload_reaches_every_dense_and_expert_unit():
    config = settle(load_config(None, [*TINY, *FSDP2, "--parallel.expert=2", "--parallel.fsdp_cpu_offload=true"]), fit_memory=False)
    for offloaded, total in run_distributed(offloaded_parameters, 2, config):
        assert offloaded == total


@pytest.mark.parametrize("args, key", [
    ([*FSDP2, "--parallel.vocab=2"], "parallel.vocab"),
    ([*FSDP2, "--parallel.expert=2", "--parallel.expert_balance=llep"], "parallel.expert_balance"),
    ([*FSDP2, "--optim.offload=true"], "optim.offload"),
    ([*FSDP2, "--parallel.expert=2", "--parallel.llep_chunks=2"], "parallel.llep_chunks"),
    ([*FSDP2, "--parallel.sequence=2", "--parallel.attention_head_chunks=2", "--model.heads=4"],
     "parallel.attention_head_chunks"),
    (["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.fsdp_cpu_offload=true"],
     "parallel.fsdp_cpu_offload"),
])
def test_settings_of_the_other_strategy_exit_2_with_one_line(tmp_path, capsys, args, key):
    assert main(["train", *TINY, *args, f"--log.run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: {key}: ") and "\n" not in err
