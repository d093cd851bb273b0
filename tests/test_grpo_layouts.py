"""Policy-gradient training on recorded rollouts exact in every layout (issue 47): the same rollouts
give the same step loss, records (TRL's, the rewards', the routing replay's mismatch per layer) and
every parameter gradient in one process and in the mop layout (Ulysses with head chunks, experts over
2 ranks with LLEP forced to spill in chunks, the vocabulary ring, checkpointing with offload; 2 and 4
ranks), for each loss type, token- and sequence-level ratios, with routing replay on, full
fine-tuning and LoRA with the base as the KL's reference; fp32.

The rollouts are sampled in the test (`mop.objectives.policy_gradient.sampling`) from the run's
model shape at other weights (seed 11): the recorded routes differ from the trained model's own
choice (so replay forces something and the mismatch record is not 0) and the sampling log-probs from
its log-probs (so the train-inference correction masks and truncates). One step covers every
rollout: all their packed sequences are one data group's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_chat import full_gradient
from torch.testing import assert_close

from mop.build import build_run
from mop.config import load_config
from mop.data.tokenizer import ByteTokenizer
from mop.models.transformer import build_model
from mop.objectives.policy_gradient import reference
from mop.objectives.policy_gradient.sampling import (
    PROMPTS,
    lowercase_share,
    rollout_rows,
)
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import canonical_name
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import train_step

MODEL = ["--model.vocab_size=259", "--model.hidden=32", "--model.layers=3", "--model.heads=8", "--model.kv_heads=2",
         "--model.head_dim=4", "--model.experts=4", "--model.top_k=2", "--model.expert_intermediate=16",
         "--model.dense_layers=1", "--model.dense_intermediate=24", "--model.aux_loss_coef=0.01"]
SEQUENCES = 4  # the packed sequences of the sampled rollouts at SEQ_LEN
SEQ_LEN = 96
GRPO = [*MODEL, "--data.format=rollouts", f"--data.seq_len={SEQ_LEN}", f"--train.global_batch={SEQUENCES}",
        "--train.micro_batch=2", "--optim.offload=false", "--rl.correction=sequence_mask", "--rl.correction_max=2.0",
        "--rl.correction_min=0.5"]
EVERY_TECHNIQUE = ["--parallel.strategy=mop", "--parallel.expert=2", "--parallel.vocab=2",
                   "--parallel.attention_head_chunks=2", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0",
                   "--parallel.llep_alpha=0.5", "--parallel.llep_min_chunk=4", "--parallel.llep_chunks=2",
                   "--train.activation_checkpointing=full", "--train.offload_activations=true"]
RECORDS = ("loss", "policy_loss", "aux_loss", "entropy", "sampling/sampling_logp_difference/mean",
           "sampling/importance_sampling_ratio/mean", "reward", "reward_std", "frac_reward_zero_std",
           "routing/replay_mismatch", "routing/replay_mismatch/layer_0", "routing/replay_mismatch/layer_1",
           "rollouts", "completion_tokens")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> str:
    config = load_config(None, MODEL)
    sampler = build_model(config.model, seed=11)
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS[:4]]
    rows = rollout_rows(sampler, prompts, group=3, max_new=12, eos_id=tokenizer.eos_id,
                        reward=lambda ids: lowercase_share(bytes(i for i in ids if i < 256)), seed=5)
    rows[2]["advantage"] = None  # a group's rollout the reward function could not score
    rows[2]["reward"] = None
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def first_step(rank: int, world: int, overrides: list[str]) -> tuple[dict, dict]:
    """The step over every rollout in a layout: its record and every parameter's full gradient."""
    config = settle(load_config(None, overrides), world, fit_memory=False)
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu")) if world > 1 else None
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    assert len(run.data.dataset) == SEQUENCES
    if config.rl.reference == "precomputed":  # the starting weights' log-probs, moved so the KL is not 0
        table = reference.compute(run, replay=True)
        run.data.dataset.reference = table + 0.3 * np.sin(np.arange(table.size)).reshape(table.shape)
    record = train_step(run, run.rank_batches(list(range(SEQUENCES)), run.data.dataset))
    grads = {canonical_name(n): full_gradient(run.views, q) if layout else q.grad.clone()
             for n, q in run.model.named_parameters() if q.requires_grad}
    return record, grads


def equal_steps(one: tuple[dict, dict], other: tuple[dict, dict]) -> None:
    (record, grads), (other_record, other_grads) = one, other
    keys = [key for key in record if key in RECORDS or key.startswith(("clip_ratio", "cispo", "kl"))]
    assert set(RECORDS) <= set(keys)
    assert {key for key in other_record if key.startswith(("clip_ratio", "cispo", "kl"))} <= set(keys)
    for key in keys:
        assert record[key] == pytest.approx(other_record[key], rel=1e-5, abs=1e-6), key
    assert grads.keys() == other_grads.keys()
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    other_norm = torch.stack([g.norm() for g in other_grads.values()]).norm()
    assert norm == pytest.approx(float(other_norm), rel=1e-4)
    for name in grads:
        assert_close(grads[name], other_grads[name], atol=1e-6, rtol=1e-4, msg=name)


VARIANTS = {  # each loss type, ratio level, fine-tuning and KL
    "dapo": ["--rl.loss_type=dapo", "--rl.epsilon_high=0.28"],
    "grpo-sequence": ["--rl.loss_type=grpo", "--rl.importance_sampling_level=sequence"],
    "dr_grpo": ["--rl.loss_type=dr_grpo", "--rl.max_completion_length=12", "--rl.correction=token_truncate"],
    "bnpo-delta": ["--rl.loss_type=bnpo", "--rl.delta=1.5", "--rl.correction=sequence_truncate"],
    "cispo": ["--rl.loss_type=cispo", "--rl.epsilon_high=5.0", "--rl.correction=token_mask"],
    "lora-kl": ["--rl.loss_type=dapo", "--train.finetune=lora", "--lora.rank=4", "--rl.beta=0.05",
                "--lora.targets=attention,routed_experts"],
    "full-kl": ["--rl.loss_type=grpo", "--rl.beta=0.05", "--rl.kl_bias_correction=false"],
}


@pytest.fixture(scope="module")
def single_process(rollouts):
    return {name: first_step(0, 1, [*GRPO, *overrides, f"--data.source={rollouts}", "--parallel.strategy=reference"])
            for name, overrides in VARIANTS.items()}


def test_the_single_process_step_replays_corrects_and_records(single_process):
    """The reference itself is not degenerate: replay forced experts the model would not choose, the
    correction masked some rollouts, the unscorable rollout counts in no reward record."""
    record = single_process["dapo"][0]
    assert 0 < record["routing/replay_mismatch"] < 1
    assert 0 < record["sampling/importance_sampling_ratio/mean"] < 1  # masked rollouts weigh 0
    assert record["rollouts"] == 12 and record["reward"] > 0 and record["reward_std"] > 0
    assert single_process["lora-kl"][0]["kl"] == 0.0  # the adapters start at zero: the policy is its base
    assert single_process["full-kl"][0]["kl"] > 0  # the moved precomputed reference
    assert single_process["cispo"][0]["cispo_clip_ratio"] == 0.0  # ratio 1: one update per batch


# dr_grpo and cispo differ from dapo only in per-token arithmetic the layouts share: the slow loop runs them
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v in ("dr_grpo", "cispo") else v
                                     for v in sorted(VARIANTS)])
def test_every_layout_gives_the_single_process_step(rollouts, single_process, variant):
    overrides = [*GRPO, *VARIANTS[variant], *EVERY_TECHNIQUE, f"--data.source={rollouts}", "--parallel.nproc=2",
                 "--parallel.sequence=2"]
    for rank in run_distributed(first_step, 2, overrides):
        equal_steps(rank, single_process[variant])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["grpo-sequence", "lora-kl"])
def test_four_ranks_give_the_single_process_step(rollouts, single_process, variant):
    overrides = [*GRPO, *VARIANTS[variant], *EVERY_TECHNIQUE, f"--data.source={rollouts}", "--parallel.nproc=4",
                 "--parallel.sequence=4"]
    for rank in run_distributed(first_step, 4, overrides):
        equal_steps(rank, single_process[variant])


TRAIN = ["--log.progress=false", "--log.tensorboard=false", "--log.plot=false", "--checkpoint.final=false",
         "--optim.lr=0.02", "--optim.warmup_steps=0", "--rl.updates_per_batch=2", "--train.global_batch=2",
         "--train.micro_batch=1"]


@pytest.fixture(scope="module")
def rollouts_without_routes(rollouts, tmp_path_factory) -> str:
    rows = [json.loads(line) for line in open(rollouts)]
    path = tmp_path_factory.mktemp("unrouted") / "rollouts.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "routed_experts"}) + "\n" for row in rows))
    return str(path)


def trained_in_both_layouts(tmp_path, common: list[str]) -> tuple[dict, list[dict], list[dict]]:
    """`mop train` of `common` as the reference and in the mop layout on 2 ranks: their run folders and
    their records (reference's, mop's)."""
    from test_train import read_metrics

    from mop.cli import main

    runs = {}
    for name, layout in (("reference", ["--parallel.strategy=reference"]),
                         ("mop", [*EVERY_TECHNIQUE, "--parallel.nproc=2", "--parallel.sequence=2"])):
        runs[name] = tmp_path / name
        assert main(["train", *common, *layout, f"--log.run_dir={runs[name]}"]) == 0
    return runs, read_metrics(runs["reference"] / "metrics.jsonl"), read_metrics(runs["mop"] / "metrics.jsonl")


@pytest.mark.parametrize("replay", ["old", pytest.param("rollout", marks=pytest.mark.slow)])
def test_several_updates_per_batch_train_as_the_reference_in_every_layout(tmp_path, rollouts, rollouts_without_routes,
                                                                          replay):
    """Two updates per batch (TRL's num_iterations): each batch is served for two steps, the second
    one's old log-probs those before the first update (its ratios move off 1, so clipping records
    appear) and, with replay "old" (R2), the routes the first step ran replayed; `mop train` in the mop
    layout gives the reference's records at every step."""
    source = rollouts if replay == "rollout" else rollouts_without_routes
    common = [*GRPO, *TRAIN, "--train.steps=4", "--checkpoint.every=2", f"--data.source={source}",
              f"--rl.replay={replay}", "--rl.correction=none", "--rl.epsilon=0.01"]
    _, expected, got = trained_in_both_layouts(tmp_path, common)
    assert [r["completion_tokens"] for r in expected[:2]] == [expected[0]["completion_tokens"]] * 2  # one batch, twice
    assert expected[0]["clip_ratio/region_mean"] == 0 < expected[1]["clip_ratio/region_mean"]
    assert expected[1]["routing/replay_mismatch"] > 0
    if replay == "old":
        assert expected[0]["routing/replay_mismatch"] == 0  # the first step replays nothing
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "policy_loss", "aux_loss", "entropy", "clip_ratio/region_mean", "routing/replay_mismatch",
                    "completion_tokens"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)


def test_a_resume_inside_a_batchs_updates_says_its_old_log_probs_are_the_resumed_weights(tmp_path, rollouts,
                                                                                         capsys):
    from mop.cli import main

    common = [*GRPO, *TRAIN, f"--data.source={rollouts}", "--parallel.strategy=reference", "--checkpoint.every=0",
              f"--log.run_dir={tmp_path / 'run'}"]
    assert main(["train", *common, "--train.steps=1", "--checkpoint.final=true"]) == 0
    assert main(["train", *common, "--train.steps=3", "--checkpoint.resume=latest"]) == 0
    assert capsys.readouterr().err.count("mop: warning: resumed inside a batch's 2 updates") == 1


def test_full_fine_tuning_with_a_kl_precomputes_its_reference_once_and_trains_as_the_reference(tmp_path, rollouts,
                                                                                              capsys):
    """Full fine-tuning with `rl.beta`: the reference is each token's log-prob under the starting
    weights, computed before the first step in the run's layout (so the first step's KL is exactly 0,
    in every layout), stored, reused by a resume, refused by a run of other data; the mop layout's
    records equal the single process's at every step."""
    from mop.cli import main

    common = [*GRPO, *TRAIN[:-3], "--train.steps=3", "--checkpoint.every=1", f"--data.source={rollouts}",
              "--rl.beta=0.1", "--optim.lr=0.01"]
    runs, expected, got = trained_in_both_layouts(tmp_path, common)
    assert expected[0]["kl"] == got[0]["kl"] == 0.0 and expected[-1]["kl"] > 0
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "policy_loss", "kl", "entropy", "routing/replay_mismatch"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    stored = json.loads((runs["mop"] / "reference" / "manifest.json").read_text())
    assert stored["weights"]["kind"] == "initial"
    resumed = [*common, "--parallel.strategy=reference", f"--log.run_dir={runs['reference']}",
               "--checkpoint.resume=latest", "--train.steps=4"]
    assert main(["train", *resumed]) == 0
    assert main(["train", *common, "--parallel.strategy=reference", f"--log.run_dir={tmp_path / 'other'}",
                 "--data.seq_len=128", f"--rl.reference_dir={runs['reference'] / 'reference'}"]) != 0
    assert "rl.reference_dir" in capsys.readouterr().err
