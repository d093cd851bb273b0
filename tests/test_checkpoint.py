"""Checkpoints: resume equals an uninterrupted run (also across layouts and world sizes), saves are
atomic and pruned, and `mop convert` round-trips. A rank killed mid-run is tests/test_faults.py's:
it is named, and its run resumes from its last checkpoint exactly."""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mop import checkpoint
from mop.cli import main
from mop.config import Config, ConfigError
from mop.data import ByteTokenizer
from mop.metrics import read_metrics
from mop.models.config import ModelConfig
from mop.models.hf import load_hf
from mop.models.transformer import build_model
from mop.optim.optimizer import DeviceAdamW
from test_train import TINY, losses

# A run of 8 steps saving every 4; resumed runs continue from its step_4 or from their own.
STEPS = ["--train.steps=8", "--checkpoint.every=4"]
MOP_W2 = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
          "--parallel.vocab=2", "--optim.offload=true", "--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4",
          "--parallel.llep_gate=1.0"]
MOP_W4 = ["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=2", "--parallel.expert=4",
          "--parallel.vocab=4"]


def train(run_dir: Path, *extra) -> list[dict]:
    assert main(["train", *TINY, f"--log.run_dir={run_dir}", *extra]) == 0
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference run, uninterrupted, with its checkpoints."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return run_dir, train(run_dir, *STEPS)


def test_resume_continues_exactly_where_the_run_stopped(tmp_path, straight):
    run_dir, records = straight
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")] == ["step_4", "step_8"]
    resumed = train(tmp_path / "resumed", *STEPS, f"--checkpoint.resume={run_dir / 'checkpoints/step_4'}")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]  # after checkpoint step_4's 4 steps
    assert losses(resumed) == losses(records)[4:]  # one process, same kernels: bit for bit


def test_resume_latest_continues_the_run_directory_and_its_metrics(tmp_path, straight):
    run_dir, records = straight
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(run_dir), str(copy)], check=True)
    (copy / "checkpoints/step_8").rename(copy / "checkpoints/step_8.partial")  # as if the last save never finished
    continued = train(copy, *STEPS, "--checkpoint.resume=latest")  # the run directory's whole metrics file
    assert [r["step"] for r in continued] == list(range(1, 9))
    assert losses(continued) == losses(records)
    assert not list((copy / "checkpoints").glob("*.partial"))


@pytest.mark.slow
def test_resume_across_layouts_and_world_sizes(tmp_path, straight):
    """Saved by the full mop layout on 2 ranks (host optimizer), resumed by the reference and by
    W=4 (torch AdamW); saved by the reference, resumed by the full layout on 2 ranks."""
    _, records = straight
    mop_dir = tmp_path / "mop2"
    on_two = train(mop_dir, *STEPS, *MOP_W2)
    assert losses(on_two) == pytest.approx(losses(records), rel=1e-4)
    step_4 = mop_dir / "checkpoints/step_4"
    by_reference = train(tmp_path / "ref", *STEPS, f"--checkpoint.resume={step_4}")
    by_four = train(tmp_path / "w4", *STEPS, *MOP_W4, f"--checkpoint.resume={step_4}")
    back_to_two = train(tmp_path / "back", *STEPS, *MOP_W2, f"--checkpoint.resume={straight[0] / 'checkpoints/step_4'}")
    for resumed in (by_reference, by_four, back_to_two):
        assert [r["step"] for r in resumed] == [5, 6, 7, 8]
        assert losses(resumed) == pytest.approx(losses(records)[4:], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_family_resumes_across_layouts(tmp_path, family):
    """Latent attention with auxiliary-loss-free balancing on (the moving score-correction biases are
    buffers the checkpoint keeps), and gpt-oss (sinks, windows, biased experts): saved by the full
    layout on 2 ranks, resumed by the reference, and the other way round, both continue the
    uninterrupted run."""
    from test_deepseek_v3 import DEEPSEEK_RUN
    from test_gpt_oss import GPT_OSS_RUN

    model = {"deepseek_v3": DEEPSEEK_RUN, "gpt_oss": GPT_OSS_RUN}[family]
    straight = train(tmp_path / "straight", *STEPS, *model)
    on_two = train(tmp_path / "mop2", *STEPS, *model, *MOP_W2)
    assert losses(on_two) == pytest.approx(losses(straight), rel=1e-4)
    by_reference = train(tmp_path / "ref", *STEPS, *model, f"--checkpoint.resume={tmp_path / 'mop2/checkpoints/step_4'}")
    back_to_two = train(tmp_path / "back", *STEPS, *model, *MOP_W2,
                        f"--checkpoint.resume={tmp_path / 'straight/checkpoints/step_4'}")
    for resumed in (by_reference, back_to_two):
        assert [r["step"] for r in resumed] == [5, 6, 7, 8]
        assert losses(resumed) == pytest.approx(losses(straight)[4:], rel=1e-4)


def _tiny_model_and_optimizer():
    model = build_model(ModelConfig(vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, experts=2,
                                    expert_intermediate=8), seed=0)
    return model, DeviceAdamW(torch.optim.AdamW(model.parameters()), model, None, torch.device("cpu"), {})


def test_a_crash_mid_save_keeps_the_previous_checkpoint_and_old_ones_are_pruned(tmp_path, monkeypatch):
    model, optimizer = _tiny_model_and_optimizer()
    views = checkpoint.GlobalViews(model, None)

    def save(step):
        return checkpoint.save(tmp_path, step, model, optimizer, views, {"position": 0}, Config(), 2,
                               ByteTokenizer())

    for step in (1, 2, 3):
        save(step)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_2", "step_3"]
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_3").rglob("*") if p.is_file()}

    def crash(state_dict, checkpoint_id, **kwargs):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a tensor")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(ConfigError, match=f"checkpoint.dir: {tmp_path} cannot be written \\(disk full\\)"):
        save(4)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert (tmp_path / "step_4.partial").is_dir()
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_3").rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    fresh, fresh_optimizer = _tiny_model_and_optimizer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    checkpoint.load(tmp_path / "step_3", fresh, fresh_optimizer, checkpoint.GlobalViews(fresh, None))
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    save(5)  # also removes the leftover partial directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_5"]


def test_convert_round_trips_between_checkpoints_and_hugging_face(tmp_path, straight):
    step_8 = straight[0] / "checkpoints/step_8"
    assert main(["convert", "to-hf", str(step_8), str(tmp_path / "hf"), "--dtype=float32"]) == 0
    exported = load_hf(tmp_path / "hf")
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "imported"), str(tmp_path / "hf2"), "--dtype=float32"]) == 0
    again = load_hf(tmp_path / "hf2")
    for (name, a), b in zip(exported.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
    tune = tmp_path / "tune"
    assert main(["train", str(tmp_path / "imported/model.toml"), *TINY, "--train.steps=2", f"--log.run_dir={tune}",
                 f"--checkpoint.resume={tmp_path / 'imported'}"]) == 0
    records = read_metrics(tune / "metrics.jsonl")
    assert len(records) == 2 and all(r["loss"] < read_metrics(straight[0] / "metrics.jsonl")[0]["loss"] for r in records)


def test_resuming_a_checkpoint_of_another_model_names_the_setting(tmp_path, straight, capsys):
    step_4 = straight[0] / "checkpoints/step_4"
    assert main(["train", *TINY, "--model.hidden=64", f"--log.run_dir={tmp_path / 'x'}",
                 f"--checkpoint.resume={step_4}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: model.hidden:") and "\n" not in err


@pytest.mark.parametrize("damage", ["truncated", "missing", "metadata"])
def test_a_damaged_checkpoint_is_one_line_naming_it(tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=2", f"--log.run_dir={run_dir}"]) == 0
    step = run_dir / "checkpoints/step_2"
    files = sorted(step.glob("*.distcp"))
    if damage == "truncated":
        files[0].write_bytes(files[0].read_bytes()[:100])
    elif damage == "missing":
        files[0].unlink()
    else:
        (step / "mop.json").write_text("{not json")
    capsys.readouterr()
    assert main(["train", *TINY, "--train.steps=3", f"--log.run_dir={tmp_path / 'b'}",
                 f"--checkpoint.resume={step}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mop: error: checkpoint.resume: {step} cannot be read (") and "\n" not in err
