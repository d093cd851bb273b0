"""`mop bench e2e` at a tiny size: what it writes, how it marks a configuration OOM, where it stops it.

The tiny model has a large vocabulary for its width, so plain fsdp2's full logits dominate its
memory, as they do at the benchmark's size; the budget is set between plain fsdp2's memory at the
first two contexts, measured first.
"""

import json
import statistics

import pytest

from mop.cli import main

GIB = 2**30

TINY = ["--vocab=2048", "--hidden=16", "--layers=2", "--heads=2", "--kv-heads=1", "--head-dim=8", "--experts=4",
        "--intermediate=16", "--head-chunks=1", "--llep-chunks=2", "--token-block=16", "--min-context=64",
        "--max-context=256", "--mop-configs=plain,ac+offload+chunked", "--fsdp2-configs=plain",
        "--steps=1", "--rounds=2"]


def bench(out, *argv: str) -> dict:
    """What `mop bench e2e` writes to its JSON."""
    assert main(["bench", "e2e", *TINY, *argv, f"--out={out}"]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sweep_marks_oom_stops_the_configuration_and_writes_json_and_png(tmp_path):
    probe = bench(tmp_path / "probe.json", "--budget-gib=1", "--max-context=128", "--mop-configs=plain")
    plain = [r["device"] for r in probe["points"] if r["config"] == "fsdp2 plain"]
    assert len(plain) == 2 and plain[1] > plain[0]  # full logits: memory grows with the context
    out = tmp_path / "e2e.json"
    results = bench(out, f"--budget-gib={(plain[0] + plain[1]) / 2 / GIB}")

    rows = {(r["config"], r["context"]): r for r in results["points"]}
    assert rows["fsdp2 plain", 64]["fits"] and not rows["fsdp2 plain", 128]["fits"]
    assert rows["fsdp2 plain", 128]["tokens_per_s_per_rank"] is None  # over budget: not timed
    assert ("fsdp2 plain", 256) not in rows  # OOM once: not run at longer contexts
    for name in ("mop plain", "mop ac+offload+chunked"):
        mop = [rows[name, context] for context in (64, 128, 256)]
        assert all(r["fits"] and r["tokens_per_s_per_rank"] > 0 for r in mop)
        assert mop[2]["device"] > mop[0]["device"]
    for context, row in zip((64, 128, 256), results["table1"]):
        mop = [rows[name, context] for name in ("mop plain", "mop ac+offload+chunked")]
        assert row["mop_best"] == max(mop, key=lambda r: r["tokens_per_s_per_rank"])["config"]
    assert [r["fsdp2_best"] for r in results["table1"]] == ["fsdp2 plain", None, None]
    assert results["targets"]["context_ratio"] == 4
    # The speed target is judged by the rematch at the longest context both fit: 2 rounds each.
    match = results["rematch"]
    assert match["context"] == 64 and match["fsdp2_best"] == "fsdp2 plain"
    assert match["mop_best"] == results["table1"][0]["mop_best"]
    assert len(match["mop_tokens_per_s"]) == len(match["fsdp2_tokens_per_s"]) == 2
    assert results["targets"]["speedup_at_longest_common_context"] == pytest.approx(
        statistics.median(match["mop_tokens_per_s"]) / statistics.median(match["fsdp2_tokens_per_s"]))

    assert results["bench"] == "e2e"
    assert out.with_suffix(".png").stat().st_size > 0


def test_bad_configuration_names_the_option_and_exits_2(capsys):
    assert main(["bench", "e2e", "--fsdp2-configs=ac+fast"]) == 2
    assert "--fsdp2-configs: unknown option 'fast'" in capsys.readouterr().err
    assert main(["bench", "e2e", "--mop-configs=offload"]) == 2  # offloads checkpointed inputs: needs ac
    assert "--mop-configs: 'offload' makes an invalid config" in capsys.readouterr().err
