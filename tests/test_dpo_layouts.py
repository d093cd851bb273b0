"""DPO exact in every layout (issue 39): the same preference pairs packed with their prompt once
(`data.shared_prompt`) or as prompt+chosen and prompt+rejected give the same step loss, records and
every parameter gradient, in one process and in the mop layout (Ulysses with head chunks, LLEP
forced to spill in chunks, the vocabulary ring, checkpointing with offload), fp32; and `mop train`'s
DPO runs, LoRA with the base as reference and full fine-tuning with a precomputed one, give the
reference's losses in every layout.

One step covers every pair: the shipped pairs picked (short ones, a multi-turn prompt, one with
tools) fit one sequence either way, which one data group of D ranks holds.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_chat import full_gradient
from test_train import read_metrics
from torch.testing import assert_close

from mop.build import build_run
from mop.cli import main
from mop.config import load_config
from mop.objectives.preference import reference
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import canonical_name
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import train_step

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "mop" / "data" / "assets" / "qwen3"
PICKED = (24, 93, 279, 219)  # two short prompts, a multi-turn one, one with tools
MODEL = ["--model.vocab_size=584", "--model.hidden=32", "--model.layers=2", "--model.heads=8", "--model.kv_heads=2",
         "--model.head_dim=4", "--model.experts=4", "--model.top_k=2", "--model.expert_intermediate=16",
         "--model.dense_layers=1", "--model.dense_intermediate=24"]
DPO = [*MODEL, "--data.format=preference", f"--data.tokenizer={QWEN3}", "--data.seq_len=1536",
       "--train.global_batch=1", "--train.micro_batch=1", "--optim.offload=false", "--dpo.nll_alpha=0.5",
       "--dpo.beta=0.2", "--model.aux_loss_coef=0"]
EVERY_TECHNIQUE = ["--parallel.strategy=mop", "--parallel.expert=2", "--parallel.vocab=2",
                   "--parallel.attention_head_chunks=2", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0",
                   "--parallel.llep_alpha=0.5", "--parallel.llep_min_chunk=4", "--parallel.llep_chunks=2",
                   "--train.activation_checkpointing=full", "--train.offload_activations=true"]


def pairs_source(tmp_path) -> str:
    rows = (ROOT / "mop" / "data" / "corpus" / "preferences.jsonl").read_text().splitlines()
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(rows[i] for i in PICKED) + "\n")
    return str(path)


def first_step(rank: int, world: int, overrides: list[str]) -> tuple[dict, dict]:
    """The step over every pair in a layout: its record and every parameter's full gradient. The
    reference log-probs are the starting weights' (computed in the layout) moved by a per-pair
    offset, so the pairs' rewards differ."""
    config = settle(load_config(None, overrides), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu")) if world > 1 else None
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    dataset = run.data.dataset
    assert len(dataset) == 1 and dataset.pairs_max == len(PICKED)
    table = reference.compute(run)
    dataset.reference = table + (np.arange(len(table))[:, None] - 1.5) * np.array([[0.7, -0.4]])
    record = train_step(run, run.rank_batches([0], dataset))
    grads = {canonical_name(n): full_gradient(run.views, q) if layout else q.grad.clone()
             for n, q in run.model.named_parameters() if q.requires_grad}
    return record, grads


def equal_steps(one: tuple[dict, dict], other: tuple[dict, dict]) -> None:
    (record, grads), (other_record, other_grads) = one, other
    for key in ("loss", "dpo_loss", "nll_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected", "pairs"):
        assert record[key] == pytest.approx(other_record[key], rel=1e-5, abs=1e-6), key
    assert grads.keys() == other_grads.keys()
    for name in grads:
        assert_close(grads[name], other_grads[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def reference_steps(tmp_path_factory):
    source = pairs_source(tmp_path_factory.mktemp("pairs"))
    base = [*DPO, f"--data.source={source}", "--parallel.strategy=reference"]
    return source, {shared: first_step(0, 1, [*base, f"--data.shared_prompt={str(shared).lower()}"])
                    for shared in (True, False)}


def test_the_prompt_once_gives_the_loss_and_gradients_of_the_pairs_run_unshared(reference_steps):
    _, steps = reference_steps
    equal_steps(steps[True], steps[False])
    record = steps[True][0]
    assert record["pairs"] == len(PICKED) and 0 < record["rewards/accuracies"] < 1  # the offsets move the rewards
    assert record["loss"] == pytest.approx(record["dpo_loss"] + 0.5 * record["nll_loss"])


@pytest.mark.parametrize("world, sequence", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("shared", [True, False])
def test_every_layout_gives_the_single_process_step(reference_steps, world, sequence, shared):
    source, steps = reference_steps
    overrides = [*DPO, *EVERY_TECHNIQUE, f"--data.source={source}", f"--parallel.nproc={world}",
                 f"--parallel.sequence={sequence}", f"--data.shared_prompt={str(shared).lower()}"]
    ranks = run_distributed(first_step, world, overrides)
    for rank in ranks:
        equal_steps(rank, steps[True])


def test_one_ranks_tiled_logits_give_the_single_process_step(reference_steps):
    """One vocabulary rank with its logits tiled (`mop.parallel.vocab.TiledHead`, issue 50): DPO's
    per-token log-probs in blocks of 64 tokens, re-formed in the backward."""
    source, steps = reference_steps
    overrides = [*DPO, *EVERY_TECHNIQUE, f"--data.source={source}", "--parallel.nproc=2", "--parallel.sequence=2",
                 "--parallel.vocab=1",
                 "--parallel.vocab_logits=recompute", "--parallel.vocab_token_block=64", "--data.shared_prompt=true"]
    for rank in run_distributed(first_step, 2, overrides):
        equal_steps(rank, steps[True])


def first_step_against_its_own_reference(rank: int, world: int, overrides: list[str]) -> dict:
    """The first step's record with the reference precomputed from the same weights, as `mop train`
    computes it (`reference.compute` then the stream's first global batch)."""
    config = settle(load_config(None, overrides), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    run.data.dataset.reference = reference.compute(run)
    return train_step(run, run.next_batches())


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_a_policy_and_its_precomputed_reference_of_the_same_weights_are_bit_for_bit_equal(tmp_path, dtype):
    """Step 0 of full fine-tuning: the float64 reference sums reach the loss unrounded (not cast to the
    compute dtype on their way into the model) and equal the policy's own, so rewards are exactly 0
    and no pair counts as won (TRL's step-0 records)."""
    overrides = [*DPO, *EVERY_TECHNIQUE, f"--data.source={pairs_source(tmp_path)}", "--parallel.nproc=2",
                 "--parallel.sequence=2", f"--train.dtype={dtype}", "--train.global_batch=2"]
    for record in run_distributed(first_step_against_its_own_reference, 2, overrides):
        assert record["pairs"] > 0
        assert [record[key] for key in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                        "rewards/accuracies")] == [0.0] * 4
        assert record["dpo_loss"] == pytest.approx(np.log(2), rel=1e-12)


TRAIN = ["--train.steps=3", "--log.progress=false", "--log.tensorboard=false", "--log.plot=false",
         "--checkpoint.every=0", "--checkpoint.final=false", "--optim.lr=0.01", "--model.aux_loss_coef=0.01"]


@pytest.mark.parametrize("finetune", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_every_layout_trains_dpo_as_the_reference(tmp_path, finetune):
    source = pairs_source(tmp_path)
    common = [*DPO[:-1], *TRAIN, f"--data.source={source}", f"--train.finetune={finetune}", "--lora.rank=4"]
    reference_run = tmp_path / "reference"
    assert main(["train", *common, "--parallel.strategy=reference", f"--log.run_dir={reference_run}"]) == 0
    mop_run = tmp_path / "mop"
    assert main(["train", *common, *EVERY_TECHNIQUE, "--parallel.nproc=2", "--parallel.sequence=2",
                 f"--log.run_dir={mop_run}"]) == 0
    expected, got = read_metrics(reference_run / "metrics.jsonl"), read_metrics(mop_run / "metrics.jsonl")
    assert expected[0]["dpo_loss"] == pytest.approx(np.log(2), rel=1e-6)  # the policy starts as its reference
    assert expected[0]["rewards/margins"] == got[0]["rewards/margins"] == 0.0  # bit for bit: as TRL's first step
    assert expected[0]["rewards/accuracies"] == got[0]["rewards/accuracies"] == 0.0
    assert expected[-1]["rewards/margins"] != 0
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "dpo_loss", "aux_loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    if finetune == "full":
        stored = json.loads((mop_run / "reference" / "manifest.json").read_text())
        assert stored["weights"]["kind"] == "initial"


def test_a_stored_reference_serves_only_the_weights_data_and_dtype_it_was_computed_from(tmp_path, capsys):
    """A precomputed reference is refused by a start from other weights (a LoRA base stored as fp8 is
    not the same seed's full weights) and by a resume with other settings; its own resume reuses it."""
    source = pairs_source(tmp_path)
    common = [*DPO, *TRAIN[1:], f"--data.source={source}", "--parallel.strategy=reference", "--train.steps=1",
              "--checkpoint.every=1"]
    first = tmp_path / "first"
    assert main(["train", *common, f"--log.run_dir={first}"]) == 0
    stored = first / "reference"
    assert main(["train", *common, f"--log.run_dir={tmp_path / 'lora'}", "--train.finetune=lora",
                 "--lora.base_format=fp8:8x8", "--dpo.reference=precomputed", f"--dpo.reference_dir={stored}"]) != 0
    assert "dpo.reference_dir" in capsys.readouterr().err
    resumed = [*common, f"--log.run_dir={first}", "--checkpoint.resume=latest", "--train.steps=2"]
    assert main(["train", *resumed, "--dpo.beta=0.3"]) == 0  # the table serves another beta
    assert main(["train", *resumed, "--train.steps=3", "--train.dtype=bfloat16"]) != 0
    assert "dpo.reference: the checkpoint's reference log-probs" in capsys.readouterr().err


def test_a_degenerate_pair_is_counted_and_warned_about_once(tmp_path, capsys):
    """A pair whose responses are the same tokens trains (TRL's way) but is said: one warning naming
    its row, the start line's count and every record's `data_degenerate_pairs`."""
    rows = (ROOT / "mop" / "data" / "corpus" / "preferences.jsonl").read_text().splitlines()
    same = json.loads(rows[PICKED[0]])
    same["rejected"] = same["chosen"]
    source = tmp_path / "pairs.jsonl"
    source.write_text("\n".join([rows[PICKED[1]], json.dumps(same)]) + "\n")
    run_dir = tmp_path / "run"
    assert main(["train", *DPO, *TRAIN, "--train.steps=2", "--parallel.strategy=reference",
                 f"--data.source={source}", f"--log.run_dir={run_dir}"]) == 0
    out, err = capsys.readouterr()
    assert "; 1 degenerate)" in out
    warnings = [line for line in err.splitlines() if line.startswith("mop: warning:")]
    assert warnings == [f"mop: warning: 1 preference pair(s) have the same chosen and rejected tokens (e.g. {source} "
                        "row 2): each adds a constant to the loss, no gradient and a miss to rewards/accuracies; set "
                        "data.skip_invalid = true to drop them"]
    assert [r["data_degenerate_pairs"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 1]
