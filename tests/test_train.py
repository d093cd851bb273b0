"""End to end: `mop train` on a tiny model, reference against the distributed `mop` strategy.

Runs go through the real command line (in-process `main`, or torchrun in a subprocess), so the
launcher, the config validation, the data split, metrics and plots are all exercised.
"""

import io
import json
import subprocess
import sys
import threading

import pytest
import torch

from mop.cli import main
from mop.config import ConfigError, load_config
from mop.metrics import read_metrics
from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from mop.progress import StepProgress
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import cuda_ranks_available
from mop.train import _train
from conftest import devices

# The reference layout, explicitly: tests that run another strategy override only what they test.
REFERENCE_LAYOUT = ["--parallel.strategy=reference", "--parallel.sequence=1", "--parallel.expert=1",
                    "--parallel.vocab=1", "--parallel.expert_balance=ep", "--optim.offload=false"]
TINY_RUN = ["--model.hidden=32", "--model.layers=2", "--model.heads=2", "--model.kv_heads=1", "--model.head_dim=16",
            "--model.experts=4", "--model.expert_intermediate=32", "--data.seq_len=32", "--train.global_batch=4",
            "--train.micro_batch=2", "--train.steps=5", "--log.progress=false", "--log.tensorboard=false", "--log.plot=false"]
TINY = [*REFERENCE_LAYOUT, *TINY_RUN]
REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"}


def run(tmp_path, name, *extra):
    run_dir = tmp_path / name
    assert main(["train", *TINY, f"--log.run_dir={run_dir}", *extra]) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), "reference")


def test_reference_writes_metrics_tensorboard_and_plot(tmp_path):
    records = run(tmp_path, "full", "--log.tensorboard=true", "--log.plot=true", "--log.profile_step=1")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # the steps done after each, as checkpoints name them
    assert all(REQUIRED <= r.keys() for r in records)
    # one process: every phase computes, none communicates
    assert all(records[0][f"time_{p}_s"] > 0 and records[0][f"time_{p}_comm_s"] == 0
               for p in ("attention", "experts", "vocabulary", "other"))
    # torch AdamW: fp32 weights, gradients until the update and two fp32 moments on the device.
    assert [records[0][f"device_bytes_per_param_{k}"] for k in ("weights", "gradients", "optimizer")] == [4, 4, 8]
    assert list((tmp_path / "full/tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "full/loss.png").stat().st_size > 1000


def test_micro_batching_does_not_change_the_losses(tmp_path, reference):
    one_pass = run(tmp_path, "m4", "--train.micro_batch=4")
    assert losses(one_pass) == pytest.approx(losses(reference), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("device", devices(2))
def test_mop_on_two_ranks_matches_the_reference(tmp_path, reference, device):
    """On CUDA: the same run on 2 GPUs (NCCL), against the CPU reference (fp32; TF32 is off by default)."""
    records = run(tmp_path, "mop2", "--parallel.strategy=mop", "--parallel.nproc=2", f"--train.device={device}")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ranks_available(1), reason="needs a GPU")
def test_one_gpu_trains_in_bf16_with_the_host_optimizer(tmp_path, reference):
    """Every single-rank CUDA path at once: meta construction on the GPU, bf16 working weights, the
    host optimizer's pinned copies and streams, document attention's GPU kernel. bf16 against the
    fp32 CPU reference: bf16 keeps 8 significant bits; on the CPU the same bf16 run is within 1e-5
    of it over these 5 steps, 2^-6 leaves room for the GPU's other kernels."""
    records = run(tmp_path, "gpu", "--train.device=cuda", "--train.dtype=bfloat16", "--optim.offload=true")
    assert losses(records) == pytest.approx(losses(reference), rel=2**-6)
    assert records[0]["device_bytes_per_param_weights"] == 2 and records[0]["device_bytes_per_param_gradients"] == 0


@pytest.mark.parametrize("device", devices(1))
def test_the_mop_strategy_on_one_rank_trains_like_the_reference(tmp_path, reference, device):
    """One GPU is a cluster: `mop train` with the automatic rank count launches one rank per GPU
    (one on a one-GPU machine; here asked for on the CPU) and runs the mop path with W = 1: FSDP2
    over one rank, the host optimizer, activation checkpointing with offload. fp32 on the CPU is
    the reference to 1e-5; bf16 on the GPU (flash varlen attention, pinned copies) to 2^-6, as above."""
    mop_one = ["--parallel.strategy=mop", "--parallel.sequence=0", "--parallel.expert=0", "--parallel.vocab=0",
               "--parallel.expert_balance=auto", "--optim.offload=auto", "--train.activation_checkpointing=full",
               "--train.offload_activations=true"]
    if device == "cpu":
        records = run(tmp_path, "one", *mop_one, "--parallel.nproc=1")
        assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    else:
        records = run(tmp_path, "one", *mop_one, "--train.dtype=bfloat16", "--parallel.nproc=0" if
                      torch.cuda.device_count() == 1 else "--parallel.nproc=1")
        assert losses(records) == pytest.approx(losses(reference), rel=2**-6)
    config = json.loads((tmp_path / "one/config.json").read_text())
    assert (config["parallel"]["nproc"], config["optim"]["offload"]) == (1, True)
    assert records[0]["device_bytes_per_param_gradients"] == 0


@pytest.mark.slow
def test_sequence_parallel_training_matches_the_reference(tmp_path, reference):
    records = run(tmp_path, "ulysses", "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2",
                  "--train.activation_checkpointing=full", "--train.offload_activations=true")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("balance, chunks", [("ep", 1), ("llep", 1), ("llep", 3)])
def test_expert_parallel_training_matches_the_reference(tmp_path, reference, balance, chunks):
    records = run(tmp_path, balance, "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.expert=2",
                  f"--parallel.expert_balance={balance}", "--parallel.llep_min_chunk=4", "--parallel.llep_gate=1.0",
                  f"--parallel.llep_chunks={chunks}")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert all(r["rank_load_imbalance_before"] >= 1.0 for r in records)
    if balance == "llep":
        assert sum(r["llep_active"] for r in records) > 0


@pytest.mark.slow
def test_vocabulary_parallel_training_matches_the_reference(tmp_path, reference):
    records = run(tmp_path, "vocab", "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.vocab=2",
                  "--parallel.vocab_token_block=16")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


@pytest.mark.slow
def test_every_technique_at_once_matches_the_reference(tmp_path, reference):
    records = run(tmp_path, "all", "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2",
                  "--parallel.expert=2", "--parallel.vocab=2", "--parallel.expert_balance=llep",
                  "--parallel.llep_min_chunk=4", "--parallel.llep_gate=1.0", "--parallel.llep_chunks=2",
                  "--train.activation_checkpointing=full",
                  "--train.offload_activations=true", "--log.profile_step=2")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)  # the profiled step too
    # The profiled step's time split: every phase ran, and each with its collectives (Ulysses'
    # all-to-alls, the expert dispatch and LLEP's transfers, the ring's shard hops, FSDP2's gathers).
    profiled = records[1]
    for phase in ("attention", "experts", "vocabulary", "other"):
        assert 0 < profiled[f"time_{phase}_comm_s"] < profiled[f"time_{phase}_s"] < profiled["step_time_s"], phase
    assert 0 <= profiled["time_untracked_s"] < profiled["step_time_s"]
    assert not any(key.startswith("time_") for r in records if r["step"] != 2 for key in r)
    # Each rank's micro-batch is 2 sequences of 16 of its 32 tokens: both blocks' fp32 inputs
    # ([2, 16, 32]) are in host memory at the peak, between the forward and the backward.
    assert all(r["mem_offloaded_activations_bytes"] >= 2 * (2 * 16 * 32 * 4) for r in records)
    assert all(len(r["peak_mem_bytes_per_rank"]) == 2 and max(r["peak_mem_bytes_per_rank"]) == r["peak_mem_bytes"]
               for r in records)


def test_host_optimizer_matches_the_reference(tmp_path, reference):
    records = run(tmp_path, "offload", "--optim.offload=true")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert all("rollback" in r for r in records)


@pytest.mark.slow
def test_host_optimizer_with_every_technique_matches_the_reference(tmp_path, reference):
    records = run(tmp_path, "offload-all", "--optim.offload=true", "--parallel.strategy=mop", "--parallel.nproc=2",
                  "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)


@pytest.mark.slow
def test_the_same_command_runs_under_torchrun(tmp_path, reference):
    run_dir = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mop.cli",
           "train", *TINY, "--parallel.strategy=mop", f"--log.run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assert losses(read_metrics(run_dir / "metrics.jsonl")) == pytest.approx(losses(reference), rel=1e-5)


def test_loss_falls(tmp_path):
    records = run(tmp_path, "long", "--train.steps=30", "--optim.warmup_steps=5")
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype, weight_bytes", [("float32", 4), ("bfloat16", 2)])
def test_the_default_layout_trains_with_every_technique(tmp_path, dtype, weight_bytes):
    """No parallel or optimizer settings: the automatic full MoP layout on 2 local ranks, in fp32 and
    in bf16 (bf16 working weights, fp32 masters on the host)."""
    run_dir = tmp_path / "default"
    assert main(["train", *TINY_RUN, "--train.steps=30", "--optim.warmup_steps=5", "--parallel.llep_min_chunk=4",
                 f"--train.dtype={dtype}", f"--log.run_dir={run_dir}"]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert {"rank_load_imbalance_before", "rollback", "gradients_handed_over_in_backward"} <= records[0].keys()
    assert records[0]["mem_optimizer_on_host"] and records[-1]["loss"] < records[0]["loss"] - 1.0
    # The device keeps only the working weights: no gradient kept between steps, no optimizer state.
    assert [records[0][f"device_bytes_per_param_{k}"] for k in ("weights", "gradients", "optimizer")] == \
        [weight_bytes, 0, 0]


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    run(tmp_path, "once")
    before = (tmp_path / "once/metrics.jsonl").read_text()
    assert main(["train", *TINY, f"--log.run_dir={tmp_path / 'once'}"]) == 2
    assert "log.overwrite" in capsys.readouterr().err
    assert (tmp_path / "once/metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_a_user_error_inside_launched_ranks_exits_2_with_one_line(tmp_path, capfd):
    code = main(["train", *TINY, "--parallel.strategy=mop", "--parallel.nproc=2",
                 f"--data.source={tmp_path / 'missing.txt'}", f"--log.run_dir={tmp_path / 'r'}"])
    assert code == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("mop: error:")]
    assert len(errors) == 1 and "missing.txt" in errors[0]


def test_bfloat16_autocast_trains_close_to_fp32(tmp_path, reference):
    low = run(tmp_path, "bf16", "--train.dtype=bfloat16")
    assert losses(low)[0] == pytest.approx(losses(reference)[0], abs=0.05)
    assert losses(low)[-1] < losses(low)[0]


def test_the_progress_bar_moves_within_a_step():
    """Each block's forward and backward of each micro-batch is an equal part of the step."""
    model = build_model(ModelConfig(vocab_size=97, hidden=16, layers=3, heads=2, kv_heads=1, head_dim=8, experts=4,
                                    expert_intermediate=8), seed=0)
    progress = StepProgress(model.layers, first_step=4, steps=10, micro_batches=2, enabled=True, stream=Terminal())
    ids = torch.randint(0, 97, (1, 8))
    loss = model(ids, ids)
    assert progress.bar.n == pytest.approx(4.25)  # 3 of the step's 12 parts: the first micro-batch's forward
    loss.backward()
    assert progress.bar.n == pytest.approx(4.5)
    progress.step_done(5, loss="1.0")
    assert progress.bar.n == 5
    progress.close()


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_without_a_terminal_progress_is_a_plain_line_every_n_steps():
    """A Slurm log gets one short line per `every` steps (and the last), never a redrawn bar."""
    model = build_model(ModelConfig(vocab_size=97, hidden=16, layers=2, heads=2, kv_heads=1, head_dim=8, experts=4,
                                    expert_intermediate=8), seed=0)
    log = io.StringIO()
    progress = StepProgress(model.layers, first_step=0, steps=7, micro_batches=1, enabled=True, every=3, stream=log)
    for done in range(1, 8):
        model(torch.randint(0, 97, (1, 8)), torch.randint(0, 97, (1, 8))).backward()
        progress.step_done(done, loss=f"{done}.0")
    progress.close()
    lines = log.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]
    assert lines[0].startswith("step 3/7 loss=3.0 elapsed") and lines[-1].endswith("about 0 s left")
    assert "\r" not in log.getvalue()


@pytest.mark.parametrize("layout", [[], pytest.param(["--parallel.strategy=mop", "--parallel.nproc=2"], marks=pytest.mark.slow)])
def test_non_finite_steps_are_counted_and_stop_the_run_keeping_the_last_good_checkpoint(tmp_path, capfd, layout):
    """lr 1e30: step 0 is finite and its update makes every later gradient non-finite."""
    run_dir = tmp_path / "nan"
    code = main(["train", *TINY, "--train.steps=10", "--optim.lr=1e30", "--optim.warmup_steps=0",
                 "--checkpoint.every=1", "--train.max_skipped_steps=3", f"--log.run_dir={run_dir}", *layout])
    assert code == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("mop: error: train.max_skipped_steps: 3 steps in a row"), err
    assert "step_1" in err[0]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["skipped"], r["skipped_steps"]) for r in records] == [(False, 0), (True, 1), (True, 2), (True, 3)]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"]  # no checkpoint of a skipped step
    resumed = main(["train", *TINY, "--train.steps=2", f"--log.run_dir={tmp_path / 'again'}",
                    f"--checkpoint.resume={run_dir / 'checkpoints/step_1'}"])
    assert resumed == 0  # the last good checkpoint is intact


def test_a_run_ended_by_an_error_has_ended_its_worker_threads(tmp_path):
    """The host optimizer's threads end with the run, however it ends (here: non-finite steps), even
    while the error's traceback still holds the run: a rank then exits with its one line and code 2,
    not with a thread still inside torch. Every step's record is kept."""
    config = settle(load_config(None, [*TINY, "--optim.offload=true", "--train.steps=6", "--optim.lr=1e30",
                                         "--optim.warmup_steps=0", "--train.max_skipped_steps=2",
                                         f"--log.run_dir={tmp_path}"]), 1, fit_memory=False)
    with pytest.raises(ConfigError, match="train.max_skipped_steps") as stopped:
        _train(config, Runtime(0, 1, torch.device("cpu"), None))
    assert stopped.traceback  # the frames, and so the run, are still referenced here
    assert [t.name for t in threading.enumerate() if t.name.startswith("host-adamw")] == []
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_overwriting_a_run_moves_the_old_one_aside_whole(tmp_path, capsys):
    """The old run's metrics and checkpoints go aside together: the new run's checkpoints are not
    pruned against the old ones, and resuming continues the new run."""
    run_dir = tmp_path / "run"
    keep = ["--checkpoint.every=1", "--checkpoint.keep=2", f"--log.run_dir={run_dir}"]
    assert main(["train", *TINY, "--train.steps=4", *keep]) == 0
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", *TINY, "--train.steps=2", "--optim.lr=1e-4", "--log.overwrite=true", *keep]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == old_metrics
    assert sorted(p.name for p in (aside[0] / "checkpoints").iterdir()) == ["step_3", "step_4"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert f"moved to {aside[0]}" in capsys.readouterr().out
    assert main(["train", *TINY, "--train.steps=3", "--optim.lr=1e-4", "--checkpoint.resume=latest", *keep]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]  # the new run, continued


def test_a_run_directory_numbered_from_zero_resumes_numbered_by_steps_done(tmp_path):
    """metrics.jsonl numbered its records from 0 before issue 45: resumed, they are renumbered and the
    run continues with the step after its checkpoint's."""
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=2", "--checkpoint.every=2", f"--log.run_dir={run_dir}"]) == 0
    metrics = run_dir / "metrics.jsonl"
    first = read_metrics(metrics)
    metrics.write_text("".join(json.dumps({**r, "step": r["step"] - 1}) + "\n" for r in first))  # as written before
    assert main(["train", *TINY, "--train.steps=3", "--checkpoint.resume=latest", f"--log.run_dir={run_dir}"]) == 0
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3] and records[:2] == first


def test_a_resume_without_a_checkpoint_never_truncates_the_earlier_metrics(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=2", "--checkpoint.final=false", f"--log.run_dir={run_dir}"]) == 0
    earlier = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", *TINY, "--train.steps=1", "--checkpoint.resume=latest", f"--log.run_dir={run_dir}"]) == 0
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (aside / "metrics.jsonl").read_text() == earlier
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]


def test_a_resume_with_nothing_left_to_train_says_so_with_its_own_exit_code(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=2", f"--log.run_dir={run_dir}"]) == 0  # the final checkpoint
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *TINY, "--train.steps=2", "--checkpoint.resume=latest", f"--log.run_dir={run_dir}"]) == 3
    err = capsys.readouterr().err.strip()
    assert "nothing left to train" in err and "train.steps" in err and "\n" not in err
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_the_resolved_settings_are_written_and_announced(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_RUN, "--train.steps=1", "--parallel.nproc=2", f"--log.run_dir={run_dir}"]) == 0
    settings = json.loads((run_dir / "config.json").read_text())
    assert settings["parallel"]["sequence"] == 2 and settings["optim"]["offload"] is True  # automatic values resolved
    capsys.readouterr()
    assert main(["train", *TINY, "--train.steps=1", f"--log.run_dir={tmp_path / 'ref'}"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("mop: reference on 1 rank(s) (one process, cpu), float32") and "config.json" in first


def test_the_eos_message_names_a_setting_that_exists_and_the_setting_works(tmp_path, capsys):
    from test_data import _train_bpe

    path = _train_bpe(tmp_path / "tokenizer.json", special=("<unk>", "<sep>"))
    args = ["train", *TINY, f"--data.tokenizer={path}", "--model.vocab_size=512", "--train.steps=1"]
    assert main([*args, f"--log.run_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--data.eos_token" in err and "\n" not in err
    assert main([*args, "--data.eos_token=<sep>", f"--log.run_dir={tmp_path / 'b'}"]) == 0


@pytest.mark.parametrize("setting", ["log.run_dir", "checkpoint.dir"])
def test_an_unwritable_directory_is_refused_before_training(tmp_path, capsys, setting):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = {"log.run_dir": f"--log.run_dir={blocker / 'run'}",
              "checkpoint.dir": f"--checkpoint.dir={blocker / 'ckpt'}"}[setting]
    others = [] if setting == "log.run_dir" else [f"--log.run_dir={tmp_path / 'run'}"]
    assert main(["train", *TINY, target, *others]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: {setting}: ") and "cannot be written" in err and "\n" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
