"""`mop bench gpu --dry-run`: the plan for 1, 2, 4 and 8 GPUs of 80 GiB on a host of 128 GiB fits
both memories, in the layout `mop train` resolves for that many GPUs, without a GPU; bad values are
one line."""

import json

import pytest

from mop.cli import main

GIB = 2**30
HOST = 128 * GIB
RUNS = ("host_optimizer", "torch_adamw")  # the two runs the tier compares
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
    runs = [(p["context"], name, p[name]) for p in results["plans"] for name in RUNS if p[name]]
    assert {name for _, name, _ in runs} == set(RUNS)  # both runs are planned at some context
    for context, name, run in runs:
        assert run["predicted_host_bytes"] <= results["host_budget_bytes"] < HOST, (context, name)
        assert run["predicted_peak_device_bytes"] <= results["device_budget_bytes"] < 80 * GIB, (context, name)
        # the preset's degrees (8) are automatic and resolved for the GPUs: no LayoutError
        assert run["layout"].startswith(f"D {gpus} Ep {gpus} P {gpus} "), run["layout"]
        assert ("host-optimizer" if name == "host_optimizer" else "device-adamw") in run["layout"]
    for p in results["plans"]:  # torch AdamW runs a model no larger than the host optimizer's
        if p["torch_adamw"]:
            assert p["torch_adamw"]["layers"] <= p["host_optimizer"]["layers"]


@pytest.mark.parametrize("argv, option", [(["--gpus", "0"], "--gpus"), ([], "--gpus"),
                                          (["--gpus", "3"], "train.global_batch"), (["--gpus", "2", "--layers", "-1"],
                                                                                    "--layers")])
def test_a_bad_value_is_one_line(capsys, tmp_path, argv, option):
    assert main(["bench", "gpu", "--dry-run", *argv, *MACHINE, "--out", str(tmp_path / "gpu.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: {option}: ") and "\n" not in err
