"""MFU on every device (issue 50, `mop.flops.matmul_probe`, `mop.flops.Peak`): a matrix-multiply probe
gives the peak where no table does, and every record carries MFU, the peak and the probe's figure."""

import math

import pytest
import torch
from test_train import run

from mop import flops
from mop.flops import Peak, matmul_probe


def test_the_probe_measures_once_per_device_dtype_and_thread_count():
    flops._probe.cache_clear()  # earlier tests in this process may have measured any thread count
    rate = matmul_probe(torch.device("cpu"), torch.float32)
    assert math.isfinite(rate) and rate > 0
    assert matmul_probe(torch.device("cpu"), torch.float32) == rate
    assert flops._probe.cache_info()[:2] == (1, 1)  # (hits, misses)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        matmul_probe(torch.device("cpu"), torch.float32)  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)
    assert flops._probe.cache_info()[:2] == (1, 2)


def test_the_table_peak_counts_for_a_known_gpu_in_bf16_only(monkeypatch):
    cpu = Peak.of(torch.device("cpu"), torch.float32, 5e10)
    assert (cpu.flops, cpu.probe, cpu.source) == (5e10, 5e10, "probe")
    monkeypatch.setattr(flops, "peak_flops", lambda device: 989e12)
    assert Peak.of(torch.device("cpu"), torch.bfloat16, 6e14) == Peak(989e12, 6e14, "table")
    assert Peak.of(torch.device("cpu"), torch.float32, 5e13).source == "probe"  # fp32 runs no bf16 tensor cores
    assert Peak(1e12, 2e12, "table").record(5e11) == {"mfu": 0.5, "peak_tflops": 1.0, "probe_tflops": 2.0}


def test_every_record_and_the_summary_carry_the_mfu(tmp_path, capsys):
    records = run(tmp_path, "run", "--train.steps=3")
    for record in records:
        assert record["peak_tflops"] == record["probe_tflops"] > 0  # a CPU: the probe is the peak
        assert record["mfu"] == pytest.approx(record["model_tflops_per_s_per_rank"] / record["peak_tflops"], rel=1e-12)
    assert "MFU" in capsys.readouterr().out


def test_the_phases_model_flops_add_up_and_give_each_phase_its_mfu(tmp_path):
    """`mop bench context`'s per-phase MFU, on a run's profiled step (`mop.flops.phase_flops`)."""
    import json

    from mop.bench.context import phase_mfu
    from mop.models.config import ModelConfig
    from mop.models.families import model_spec
    from mop.profiling import PHASES

    records = run(tmp_path, "run", "--train.steps=2", "--log.profile_step=2")
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    profiled = records[-1]
    spec = model_spec(ModelConfig(**resolved["model"]))
    positions = resolved["train"]["global_batch"] * resolved["data"]["seq_len"]
    split = flops.phase_flops(spec, profiled["model_flops"], positions)
    assert sum(split.values()) == pytest.approx(profiled["model_flops"], rel=1e-12)
    assert split["experts"] == 3 * spec.routed_expert_flops() * positions and min(split.values()) > 0
    mfu = phase_mfu(profiled, resolved)
    for phase in PHASES:
        expected = split[phase] / resolved["world"] / profiled[f"time_{phase}_s"] / (profiled["probe_tflops"] * 1e12)
        assert mfu[phase] == pytest.approx(expected, rel=1e-12)
