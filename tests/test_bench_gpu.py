"""`mop bench gpu --dry-run`: the plan for 1, 2, 4 and 8 GPUs of 80 GiB on a host of 128 GiB fits
both memories, in the layout `mop train` resolves for that many GPUs, without a GPU; bad values are
one line."""

import argparse
import json

import pytest

from mop.bench import gpu
from mop.cli import main
from mop.plan.cluster import GIB

HOST = 128 * GIB
MACHINE = ["--device-gib", "80", "--host-gib", "128"]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[int, dict]:
    """The JSON `mop bench gpu --dry-run` writes, per GPU count."""
    out = {}
    for gpus in (1, 2, 4, 8):
        path = tmp_path_factory.mktemp(f"gpus{gpus}") / "gpu.json"
        assert main(["bench", "gpu", "--dry-run", "--gpus", str(gpus), *MACHINE, "--out", str(path)]) == 0
        out[gpus] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_plan_fits_device_and_host_in_the_layout_of_that_many_gpus(dry_runs, gpus):
    results = dry_runs[gpus]
    runs = [(p["context"], name, p[name]) for p in results["plans"] for name in gpu.RUNS if p[name]]
    assert {name for _, name, _ in runs} == set(gpu.RUNS)  # both runs are planned at some context
    for context, name, run in runs:
        assert run["predicted_host_bytes"] <= results["host_budget_bytes"] < HOST, (context, name)
        assert run["predicted_peak_device_bytes"] <= results["device_budget_bytes"] < 80 * GIB, (context, name)
        # the preset's degrees (8) are automatic and resolved for the GPUs: no LayoutError
        assert run["layout"].startswith(f"D {gpus} Ep {gpus} P {gpus} "), run["layout"]
        assert ("host-optimizer" if name == "host_optimizer" else "device-adamw") in run["layout"]
    for p in results["plans"]:  # torch AdamW runs a model no larger than the host optimizer's
        if p["torch_adamw"]:
            assert p["torch_adamw"]["layers"] <= p["host_optimizer"]["layers"]


def test_the_old_sizing_would_not_fit_the_host(dry_runs):
    """The old rule, bf16 weights in a quarter of the GPU's memory, built 16 of the 48 blocks on one
    80 GiB GPU (10.6B parameters): about 30 bytes per parameter of host optimizer, far over 128 GiB."""
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    cluster, _ = gpu.machine(parser.parse_args(["--dry-run", "--gpus", "1", *MACHINE]))
    old = gpu.candidate(parser.parse_args([]), cluster, 8192, 16, "true")
    assert 2 * old.memory.counts.total <= 80 * GIB / 4 and old.memory.host_bytes_per_node > HOST
    planned = dry_runs[1]["plans"][-1]["host_optimizer"]  # 8K: the most blocks
    assert planned["layers"] < 16 and planned["predicted_host_bytes"] < HOST


@pytest.mark.parametrize("argv, option", [(["--gpus", "0"], "--gpus"), ([], "--gpus"),
                                          (["--gpus", "3"], "train.global_batch"), (["--gpus", "2", "--layers", "-1"],
                                                                                    "--layers")])
def test_a_bad_value_is_one_line(capsys, tmp_path, argv, option):
    assert main(["bench", "gpu", "--dry-run", *argv, *MACHINE, "--out", str(tmp_path / "gpu.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: {option}: ") and "\n" not in err
