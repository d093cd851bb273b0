"""Held-out evaluation: the split, the loss under every layout against the reference, and where it shows."""

import math

import pytest

from mop.build import build_run
from mop.cli import main
from mop.config import load_config
from mop.metrics import read_metrics
from mop.train import setup_runtime
from test_train import TINY, run

EVAL = ["--eval.every=2", "--eval.sequences=4"]


def eval_losses(records):
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("eval"), "reference", *EVAL)


def test_the_reference_evaluates_every_n_steps_and_after_the_last(reference, tmp_path, capsys):
    assert sorted(eval_losses(reference)) == [2, 4, 5]  # after steps 2 and 4, and the last
    assert all(math.isfinite(loss) and loss > 0 for loss in eval_losses(reference).values())
    run(tmp_path, "plotted", *EVAL, "--log.plot=true")
    assert "mop: held-out loss" in capsys.readouterr().out
    assert (tmp_path / "plotted/loss.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2", "--parallel.attention_head_chunks=1",
     "--train.activation_checkpointing=full", "--train.offload_activations=true", "--parallel.llep_chunks=2"],
    ["--parallel.sequence=1", "--parallel.expert=2", "--parallel.vocab=1"],
], ids=["every-technique", "data-parallel"])
def test_the_held_out_loss_under_mop_equals_the_reference(tmp_path, reference, layout):
    records = run(tmp_path, "mop", *EVAL, "--parallel.strategy=mop", "--parallel.nproc=2", "--optim.offload=true",
                  "--parallel.expert_balance=llep", *layout)
    mine, theirs = eval_losses(records), eval_losses(reference)
    assert sorted(mine) == sorted(theirs)
    for step in theirs:
        assert mine[step] == pytest.approx(theirs[step], rel=1e-5)
    # Evaluating left training untouched (routing records, host optimizer): the same training losses.
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)


def built(*overrides):
    config, runtime = setup_runtime(load_config(None, [*TINY, *overrides]))
    return build_run(config, runtime)


def test_held_out_sequences_are_the_last_ones_and_never_trained_on():
    whole = built()
    total = whole.data.stream.num_sequences
    split = built("--eval.every=1", "--eval.fraction=0.25", "--eval.sequences=4")
    kept = total - math.ceil(0.25 * total)
    assert split.data.stream.num_sequences == kept
    assert split.held_out.indices == [kept, kept + 1, kept + 2, kept + 3]
    trained = {i for _ in range(2 * total // 4) for i in split.data.stream.next_batch(4)}
    assert trained == set(range(kept))  # two epochs of training reach every kept sequence, no held-out one


def test_a_separate_source_is_read_with_the_run_s_tokenizer(tmp_path):
    corpus = tmp_path / "held_out.txt"
    corpus.write_text("\n\n".join(f"held-out document {i} " * 8 for i in range(12)))
    whole, separate = built(), built("--eval.every=1", f"--eval.source={corpus}", "--eval.sequences=2")
    assert separate.data.stream.num_sequences == whole.data.stream.num_sequences  # training keeps all of its data
    first = separate.held_out.dataset[0]["input_ids"].tolist()
    assert bytes(first[:16]).decode() == "held-out documen"  # the byte tokenizer's ids are the bytes


@pytest.mark.parametrize("setting, message", [
    (["--eval.fraction=1.5"], "eval.fraction: must be in (0, 1), got 1.5"),
    (["--eval.sequences=3"], "eval.sequences: 3 must be a multiple of data groups x train.micro_batch (2); e.g. 2"),
    (["--eval.sequences=100000"], "eval.sequences: 100000 sequences are asked for but the held-out eval.fraction"),
])
def test_impossible_evaluation_settings_are_one_line(tmp_path, capsys, setting, message):
    assert main(["train", *TINY, "--eval.every=1", f"--log.run_dir={tmp_path / 'r'}", *setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mop: error: {message}"), err


def test_a_resume_keeps_the_split(tmp_path):
    """The held-out split shortens the training stream, whose sequence count is checkpointed."""
    first = run(tmp_path, "split", *EVAL, "--train.steps=2")
    resumed = main(["train", *TINY, *EVAL, f"--log.run_dir={tmp_path / 'split'}", "--checkpoint.resume=latest"])
    assert resumed == 0 and len(read_metrics(tmp_path / "split/metrics.jsonl")) == 5 and len(first) == 2
