"""Every registered training objective keeps the contract of `mop.objectives.base` (its page:
mop/objectives/README.md), and the loop reaches objectives only through it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import mop.train
from mop.build import build_run
from mop.config import Config, DataConfig, load_config
from mop.data import count_targets, load_batch
from mop.objectives import OBJECTIVES, Objective, StepCounts, objective_for
from mop.runtime import Runtime
from mop.settle import settle

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "mop" / "data" / "assets" / "qwen3"
TINY = ["--model.hidden=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8",
        "--model.experts=4", "--model.top_k=2", "--model.expert_intermediate=16", "--parallel.strategy=reference",
        "--train.global_batch=2", "--train.micro_batch=2", "--optim.offload=false", "--log.tensorboard=false"]
CHAT = [f"--data.tokenizer={QWEN3}", "--model.vocab_size=584", "--data.seq_len=512", "--data.loss_on=assistant",
        "--data.overlong=truncate"]
# One run of each data format, each on its shipped corpus.
RUNS = {"text": ["--data.seq_len=64"],
        "chat": [*CHAT, "--data.format=chat", "--data.source=mop/data/corpus/conversations.jsonl"],
        "preference": [*CHAT, "--data.format=preference", "--data.source=mop/data/corpus/preferences.jsonl",
                       "--data.seq_len=2048", "--dpo.nll_alpha=0.5"],
        "rollouts": ["--data.format=rollouts", "--data.source=mop/data/corpus/rollouts.jsonl", "--data.seq_len=128",
                     "--model.vocab_size=259", "--model.layers=4", "--model.experts=8",
                     "--rl.importance_sampling_level=sequence", "--rl.loss_type=grpo"]}


def test_each_data_format_has_exactly_one_registered_objective():
    formats = typing.get_args(typing.get_type_hints(DataConfig)["format"])
    assert set(RUNS) == set(formats)
    for objective in OBJECTIVES.values():
        assert issubclass(objective, Objective) and not inspect.isabstract(objective), objective
        assert objective.formats and set(objective.formats) <= set(formats), objective
    for data_format in formats:
        owners = [name for name, objective in OBJECTIVES.items() if data_format in objective.formats]
        assert len(owners) == 1, (data_format, owners)


def test_every_objective_decides_only_its_own_settings():
    """`decide` fills in automatic values of its own sections; on a config it has already decided it
    changes nothing."""
    for finetune in ("full", "lora"):
        config = load_config(None, [f"--train.finetune={finetune}"])
        for objective in OBJECTIVES.values():
            decided = objective.decide(config)
            assert isinstance(decided, Config)
            assert objective.decide(decided) == decided
            changed = {f.name for f in dataclasses.fields(Config)
                       if getattr(decided, f.name) != getattr(config, f.name)}
            assert changed <= set(objective.sections), (objective, changed)


@pytest.mark.parametrize("data_format", sorted(RUNS))
def test_an_objective_gives_a_step_its_loss_parts_and_record(data_format, tmp_path):
    """On one micro-batch in one process: the loss is a differentiable scalar, the parts are float64,
    and the record's "loss" is that loss (the record is of what is optimised)."""
    config = settle(load_config(None, [*TINY, *RUNS[data_format], f"--log.run_dir={tmp_path}"]), world=1,
                    fit_memory=False)
    run = build_run(config, Runtime(0, 1, torch.device("cpu"), None))
    objective = objective_for(run)
    assert data_format in objective.formats
    assert isinstance(objective.describe(), str) and objective.describe()
    assert all(isinstance(line, str) for line in objective.warnings())
    recorded = objective.prepare(tmp_path, None)
    assert (recorded is not None) == (data_format == "preference"), recorded  # DPO's precomputed reference
    (batch,) = run.next_batches()
    own = objective.local_counts([batch])
    assert all(count >= 0 for count in own)
    counts = StepCounts(count_targets([batch]), config.train.global_batch, tuple(own))
    loss, parts, expert_stats = objective.micro_batch_loss(counts)(batch)
    assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    assert parts.dtype == torch.float64 and parts.dim() == 1
    assert expert_stats is None or expert_stats.shape[-1] == config.model.experts + 1  # counts, router entropy
    record = objective.record(parts.tolist(), counts)
    assert_close(torch.tensor(record["loss"], dtype=torch.float64), loss.detach().double(), rtol=1e-6, atol=1e-7)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in run.model.parameters())


@pytest.mark.parametrize("data_format", sorted(RUNS))
def test_an_objective_divides_by_the_whole_steps_counts(data_format, tmp_path):
    """A step's sequences as one micro-batch or one micro-batch each, with the step's counts summed
    over them: the same loss and the same record (so any layout and micro-batching optimise one
    objective). An objective that divided by a micro-batch's own counts would differ."""
    config = settle(load_config(None, [*TINY, *RUNS[data_format], f"--log.run_dir={tmp_path}"]), world=1,
                    fit_memory=False)
    run = build_run(config, Runtime(0, 1, torch.device("cpu"), None))
    objective = objective_for(run)
    objective.prepare(tmp_path, None)
    order = run.data.stream.next_batch(config.train.global_batch)
    whole, singles = load_batch(run.data.dataset, order), [load_batch(run.data.dataset, [i]) for i in order]
    own = [sum(counts) for counts in zip(*(objective.local_counts([b]) for b in singles))]
    assert own == objective.local_counts([whole])
    counts = StepCounts(count_targets([whole]), config.train.global_batch, tuple(own))
    loss = objective.micro_batch_loss(counts)
    together, parts, _ = loss(whole)
    apart = [loss(b) for b in singles]
    assert_close(sum(a[0] for a in apart), together, rtol=1e-5, atol=1e-6)
    summed = objective.record(sum(a[1] for a in apart).tolist(), counts)
    assert summed.keys() == objective.record(parts.tolist(), counts).keys()
    for key, value in objective.record(parts.tolist(), counts).items():
        assert_close(torch.tensor(summed[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
                     rtol=1e-5, atol=1e-6, msg=key)


def test_the_training_loop_never_asks_which_objective_runs():
    """mop/train.py reads no data format or objective's settings and imports no objective's module:
    it reaches the objective only through the registry and its interface."""
    tree = ast.parse(Path(inspect.getsourcefile(mop.train)).read_text())
    sections = {section for objective in OBJECTIVES.values() for section in objective.sections}
    read = [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in {"format", *sections}]
    assert not read, read
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module.startswith("mop.objectives.") and node.module != "mop.objectives.base"]
    assert not imported, imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {objective.__name__ for objective in OBJECTIVES.values()}
