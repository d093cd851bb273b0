"""Every `mop bench`, through the command line only: its help names what it measures and where it writes;
at a tiny size it runs and writes its JSON (slow: each takes 10-60 s on 2 cores). `mop bench e2e` and
`mop bench gpu` have their own files; `mop bench context` trains the long-context preset and has no tiny size."""

import json
from pathlib import Path

import pytest

from mop.bench import BENCHMARKS
from mop.cli import main

TINY = {
    "attention": ["--seq-lens=64", "--model-seq-len=64", "--hidden=32", "--heads=4", "--kv-heads=2", "--head-dim=8",
                  "--layers=1", "--head-chunks=2", "--repeats=1"],
    "dpo": ["--prompt=63", "--response=16", "--hidden=32", "--heads=4", "--kv-heads=2", "--head-dim=8", "--experts=4",
            "--intermediate=32", "--vocab=512", "--layers=2", "--steps=1"],
    "grpo": ["--tokens=128", "--rollouts=2", "--prompt=16", "--hidden=32", "--heads=4", "--kv-heads=2", "--head-dim=8",
             "--experts=4", "--intermediate=32", "--vocab=512", "--layers=2", "--steps=1"],
    "grpo-trl": ["--lengths=64", "--rollouts=2", "--prompt=16", "--hidden=32", "--heads=4", "--kv-heads=2",
                 "--head-dim=8", "--experts=4", "--intermediate=32", "--vocab=512", "--layers=2", "--mop-budgets=auto"],
    "rl-sync": ["--preset=debug", "--buckets=0.01,1"],
    "data": ["--size-mb=0.3", "--baseline-mb=0.1", "--seq-lens=1024", "--workers=2", "--agent-calls=2,4"],
    "build": [f"--config={Path(__file__).resolve().parents[1] / 'configs/debug.toml'}", "--layers=1", "--nproc=2"],
    "moe": ["--tokens=64", "--hidden=16", "--intermediate=16", "--experts=16", "--min-chunk=8", "--chunks=2",
            "--repeats=1", "--scenarios=balanced,95% -> 16"],
    "optimizer": ["--shards=2", "--shard-size=1024", "--update-steps=2", "--steps=2"],
    "plan": ["--models=mop-120b", "--contexts=128K"],
    "vocab": ["--tokens=64", "--vocabs=256", "--hidden=16", "--fix-repeats=2"],
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_help_of_every_benchmark_says_what_it_measures_and_where_it_writes(name, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert f"`mop bench {name}`" in shown and "--out" in shown


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TINY))
def test_a_tiny_run_writes_its_json(name, tmp_path):
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, *TINY[name], f"--out={out}"]) == 0
    written = json.loads(out.read_text())
    assert written["bench"] == name and set(written) - {"bench", "when", "machine", "settings"}


def test_the_moe_benchmark_refuses_fewer_experts_than_its_hot_ones_in_one_line(capsys, tmp_path):
    assert main(["bench", "moe", "--experts=8", f"--out={tmp_path / 'moe.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --experts: 8 is fewer than the 16 hot experts") and "\n" not in err
    assert main(["bench", "moe", "--scenarios=balanced,99% -> 1", f"--out={tmp_path / 'moe.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --scenarios: unknown scenario '99% -> 1'") and "\n" not in err


def test_the_plan_benchmark_names_the_models_it_takes_in_one_line(capsys, tmp_path):
    assert main(["bench", "plan", "--models=mop-2t", f"--out={tmp_path / 'plan.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --models: 'mop-2t' is not one of the paper's models; use mop-120b") and \
        "\n" not in err


def test_the_context_benchmark_takes_contexts_as_mop_plan_does_and_names_a_bad_one_in_one_line(capsys, tmp_path):
    assert main(["bench", "context", "--contexts=128K,12x", f"--out={tmp_path / 'context.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --contexts: '12x' is not a token count; write e.g. 131072, 128K or 1M") and \
        "\n" not in err


@pytest.mark.slow
def test_the_moe_benchmark_runs_a_presets_layer_at_divided_widths(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--model=deepseek-v3", "--width-divisor=448", "--tokens=64", "--min-chunk=8",
                 "--chunks=2", "--repeats=1", "--scenarios=balanced", f"--out={out}"]) == 0
    settings = json.loads(out.read_text())["settings"]
    shape = (settings["experts"], settings["top_k"], settings["hidden"], settings["intermediate"])
    assert shape == ("256", "8", "16", "4")
    assert "deepseek-v3's layer, widths / 448" in capsys.readouterr().out


def test_the_moe_benchmark_names_the_presets_it_takes_in_one_line(capsys, tmp_path):
    assert main(["bench", "moe", "--model=gpt-5", f"--out={tmp_path / 'moe.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --model: 'gpt-5' is not a preset; use one of") and "\n" not in err


def test_the_vocab_benchmark_reports_a_variant_whose_rank_was_killed_and_goes_on(capsys, tmp_path, monkeypatch):
    from mop.bench import vocab
    from mop.testing import DistributedError

    def killed_when_full(fn, world, variant, *args, **kwargs):
        if variant == "full":  # as the kernel's out-of-memory killer ends a rank of the full logits
            raise DistributedError("1 of 2 ranks failed", killed={1: 9})
        return [{"seconds": 1.0, "peak_bytes": 2 * 2**20, "weight_bytes": 2**20}] * world

    monkeypatch.setattr(vocab, "run_distributed", killed_when_full)
    out = tmp_path / "vocab.json"
    assert main(["bench", "vocab", "--tokens=64", "--vocabs=256", "--fix-repeats=0", f"--out={out}"]) == 0
    shown = capsys.readouterr().out
    assert "killed (rank 1: signal 9; out of memory?)" in shown and "lower --max-logits-gib" in shown
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["full", "tiled", "ring", "ring-kept"] and rows[0]["killed"] == {"1": 9}


@pytest.mark.slow
def test_grpo_against_trl_gives_each_system_the_loss_of_the_same_step(tmp_path):
    """The same rows and weights give mop's and TRL's step 1 the same loss, whatever budget mop is fitted
    to: to the rounding of the sequence correction, the exp of a sum of 48 log-prob differences of
    about 1e-6 each (a few fp32 ulps of log-probs near -6), so at most about 5e-5 relative."""
    out = tmp_path / "grpo-trl.json"
    assert main(["bench", "grpo-trl", *TINY["grpo-trl"], "--mop-budgets=auto,300MiB", f"--out={out}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["tokens"]) for r in rows] == [("trl", 64), ("mop", 64), ("mop@300MiB", 64)]
    assert all(r["s_per_step"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert rows[0]["loss"] != 0  # the correction weighs the rollouts unequally: a step's loss to compare
    for mine in rows[1:]:
        assert mine["loss"] == pytest.approx(rows[0]["loss"], rel=1e-4)


def test_grpo_against_trl_names_a_bad_budget_in_one_line(capsys, tmp_path):
    assert main(["bench", "grpo-trl", "--mop-budgets=lots", f"--out={tmp_path / 'g.json'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: --mop-budgets: 'lots' is not a train.memory_budget") and "\n" not in err
