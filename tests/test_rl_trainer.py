"""The trainer an RL framework drives (issue 48, `mop.trainer.Trainer`): its log-probs of rows the engine
sampled from its exported weights are the engine's sampling log-probs (1e-5); a batch of rows trains
as `mop train` trains the same rows from a file; in the mop layout (2 ranks: experts over 2 with
LLEP, the vocabulary ring) its log-probs, entropies and records are one process's; a checkpoint it
saves and loads gives the same next update; a row too long for data.seq_len is one line. Tiny
qwen3_moe, byte tokenizer, fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_rl_loop import MODEL, QUIET, REFERENCE, letters

from mop.cli import main
from mop.config import load_config
from mop.data.errors import DataError
from mop.metrics import read_metrics
from mop.parallel import DistLayout, Layout
from mop.rl.engine import TransformersEngine
from mop.rl.weights import write_folder
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.trainer import Trainer

pytest.importorskip("transformers")

SETTINGS = [*MODEL, *QUIET, "--data.seq_len=64", "--train.global_batch=4", "--train.micro_batch=2",
            "--optim.lr=0.01", "--optim.warmup_steps=0", "--train.steps=10", "--checkpoint.final=false"]
PROMPTS = [[51, 43, 52, 61], [49, 43, 48, 61], [50, 43, 50, 61]]
RECORDS = ("loss", "policy_loss", "aux_loss", "entropy", "reward", "reward_std", "grad_norm", "tokens",
           "sampling/sampling_logp_difference/mean", "routing/replay_mismatch")


def sampled_rows(trainer: Trainer, folder, seed: int = 0) -> list[dict]:
    """Rollouts of PROMPTS sampled by the CPU engine from the trainer's weights, rewarded (`letters`)."""
    write_folder(trainer.weights(dtype=torch.float32), trainer.run, folder, torch.float32)
    engine = TransformersEngine(eos_id=257)
    engine.load(folder)
    rows = engine.sample(PROMPTS, group=3, max_new_tokens=5, seed=seed)
    for k, row in enumerate(rows):
        text = bytes(t for t in row["completion_ids"] if t < 256).decode("utf-8", "replace")
        row.update(reward=letters(text, "abc"), group=str(k // 3))
    return rows


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Rows sampled from the starting weights, and one process's log-probs and first records of them."""
    tmp = tmp_path_factory.mktemp("trainer")
    trainer = Trainer(load_config(None, [*SETTINGS, *REFERENCE, f"--log.run_dir={tmp / 'run'}"]))
    rows = sampled_rows(trainer, tmp / "engine")
    values = trainer.log_probs(rows)
    records = trainer.train(rows)
    trainer.close()
    return tmp, rows, values, records


def test_the_trainers_log_probs_are_the_engines_of_its_weights(batch):
    _, rows, values, _ = batch
    for row, value in zip(rows, values):
        torch.testing.assert_close(torch.from_numpy(value["logps"]), torch.tensor(row["sampling_logps"]),
                                   rtol=1e-5, atol=1e-5)
        assert len(value["entropy"]) == len(row["completion_ids"]) and (value["entropy"] > 0).all()


def test_the_trainer_trains_rows_as_mop_train_trains_them_from_a_file(batch):
    tmp, rows, _, records = batch
    source = tmp / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # the rows fill 2 sequences: a global batch of 2 trains them once (the trainer pads its 4 with empty ones)
    assert main(["train", *SETTINGS, *REFERENCE, "--train.steps=1", "--data.format=rollouts",
                 "--train.global_batch=2", "--train.micro_batch=1", f"--data.source={source}",
                 f"--log.run_dir={tmp / 'file'}"]) == 0
    from_file = read_metrics(tmp / "file" / "metrics.jsonl")
    assert from_file[0]["data_rollouts"] == len(rows) and from_file[0]["sequences"] == 2 == records[0]["sequences"]
    np.testing.assert_allclose([records[0][k] for k in RECORDS], [from_file[0][k] for k in RECORDS],
                               rtol=1e-5, atol=1e-7)


def _in_the_mop_layout(rank: int, world: int, settings: list[str], rows: list[dict]) -> tuple[list, list]:
    config = settle(load_config(None, settings), world, fit_memory=False)
    p, device = config.parallel, torch.device("cpu")
    runtime = Runtime(rank, world, device, DistLayout(Layout(world, p.sequence, p.expert, p.vocab), device))
    trainer = Trainer(config, runtime)
    values, records = trainer.log_probs(rows), trainer.train(rows)
    trainer.close()
    return values, [[r[k] for k in RECORDS] for r in records]


@pytest.mark.slow
def test_the_trainer_in_the_mop_layout_is_one_process(tmp_path, batch):
    _, rows, values, records = batch
    settings = [*SETTINGS, "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=1",
                "--parallel.expert=2", "--parallel.vocab=2", "--parallel.expert_balance=llep", "--optim.offload=true",
                f"--log.run_dir={tmp_path / 'mop'}"]
    for got, picked in run_distributed(_in_the_mop_layout, 2, settings, rows):
        for mine, reference in zip(got, values):
            torch.testing.assert_close(torch.from_numpy(mine["logps"]), torch.from_numpy(reference["logps"]),
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.from_numpy(mine["entropy"]), torch.from_numpy(reference["entropy"]),
                                       rtol=1e-5, atol=1e-6)
        # atol: the log-prob difference record is a mean of |differences| of fp32 log-probs near 5, whose
        # rounding is 5 x 2^-23 = 6e-7, as is the policy loss's on-policy 0
        np.testing.assert_allclose(picked, [[r[k] for k in RECORDS] for r in records], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_the_trainer_saves_gives_the_same_next_update(tmp_path, batch):
    _, rows, _, _ = batch
    trainer = Trainer(load_config(None, [*SETTINGS, *REFERENCE, f"--log.run_dir={tmp_path / 'run'}"]))
    trainer.train(rows)
    saved = trainer.save()
    first = trainer.train(rows)
    trainer.train(rows)
    trainer.load(saved)
    assert trainer.step == 1
    again = trainer.train(rows)
    trainer.close()
    np.testing.assert_allclose([again[0][k] for k in RECORDS], [first[0][k] for k in RECORDS], rtol=1e-6, atol=1e-8)


def test_a_row_too_long_or_invalid_is_one_line_naming_it(tmp_path, batch):
    _, rows, _, _ = batch
    trainer = Trainer(load_config(None, [*SETTINGS, *REFERENCE, f"--log.run_dir={tmp_path / 'run'}"]))
    long = {**rows[0], "prompt_ids": [50] * 70, "routed_experts": None}
    with pytest.raises(DataError, match="data.seq_len: 1 of the 2 rows are longer than 64 tokens"):
        trainer.log_probs([long, rows[1]])
    with pytest.raises(DataError, match="the trainer's rows: row 2: its 'routed_experts' has"):
        trainer.train([rows[0], {**rows[1], "prompt_ids": [50] * 9}])
    trainer.close()
