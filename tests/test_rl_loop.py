"""The RL loop (issue 48, `mop rl`, `mop.rl.feed`): each batch the trainer's weights are synced to the
engine, which samples rollouts of the prompts; the reward scores them; the policy trains on them with
`mop train`'s loop. The engine's log-probs and routes are the trainer's (the sync is exact: the
sampling log-prob difference and the replay mismatch are 0 on-policy), the loop is exact in the mop
layout, a resume draws the batches the run would have drawn, one-step-off-policy samples with the
weights one update earlier, and starting from another run's weights (`checkpoint.init`) takes
them. Tiny model, byte tokenizer, fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mop.cli import main
from mop.data.errors import DataError
from mop.data.tokenizer import ByteTokenizer
from mop.metrics import read_metrics
from mop.models.moe import RouterStats, load_balancing_loss
from mop.rl.prompts import read_prompts
from mop.testing import cuda_ranks_available

pytest.importorskip("transformers")

MODEL = ["--model.family=qwen3_moe", "--model.vocab_size=259", "--model.hidden=32", "--model.layers=2",
         "--model.heads=2", "--model.kv_heads=1", "--model.head_dim=16", "--model.experts=4", "--model.top_k=2",
         "--model.expert_intermediate=32"]
REFERENCE = ["--parallel.strategy=reference", "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
             "--parallel.expert_balance=ep", "--optim.offload=false"]
QUIET = ["--log.progress=false", "--log.tensorboard=false", "--log.plot=false", "--eval.every=0"]
LOOP = [*MODEL, *QUIET, "--data.seq_len=64", "--train.global_batch=4", "--train.micro_batch=2", "--optim.lr=0.01",
        "--optim.warmup_steps=0", "--rl.group=4", "--rl.prompts_per_batch=3", "--rl.max_completion_length=6",
        "--rl.reward=test_rl_loop:letters", "--checkpoint.final=false"]
RECORDS = ("loss", "policy_loss", "reward", "reward_std", "entropy", "completion_tokens",
           "sampling/sampling_logp_difference/mean", "routing/replay_mismatch", "completions/mean_length")


def letters(completion: str, answer: str) -> float:
    """The tests' reward: the share of the completion's characters that are ASCII, and 1 more where it
    holds the answer's first letter (random completions score apart, so the advantages are not 0)."""
    return sum(c.isascii() for c in completion) / max(len(completion), 1) + (answer[0] in completion)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": "abcdefghijklm"[a:a + b + 2]} for a in range(3) for b in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rl(tmp_path, name, prompts, *extra):
    run_dir = tmp_path / name
    assert main(["rl", *LOOP, f"--rl.prompts={prompts}", f"--log.run_dir={run_dir}", *extra]) == 0
    return read_metrics(run_dir / "metrics.jsonl"), run_dir


def picked(records):
    return [[r[key] for key in RECORDS] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts):
    return rl(tmp_path_factory.mktemp("loop"), "reference", prompts, *REFERENCE, "--train.steps=3")


def test_the_loop_trains_on_what_the_engine_samples_with_its_weights(reference, prompts):
    records, run_dir = reference
    tokenizer, answers = ByteTokenizer(), read_prompts(str(prompts), ByteTokenizer(), None).answers
    for step, record in enumerate(records):
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"batch_{step:06d}.jsonl").open()]
        assert len(rows) == 3 * 4 and record["rollouts"] == len(rows)
        for row in rows:
            prompt = int(row["group"].split("/")[1])
            text = tokenizer.decode([t for t in row["completion_ids"] if t != tokenizer.eos_id])
            assert row["reward"] == letters(text, answers[prompt])
        rewards = np.array([row["reward"] for row in rows])
        # the packed rows hold each reward in float32 (`RolloutDataset`): the mean of those
        assert record["reward"] == pytest.approx(rewards.astype(np.float32).astype(np.float64).mean(), rel=1e-12)
        assert record["completions/mean_length"] == np.mean([len(row["completion_ids"]) for row in rows])
        # the synced engine is the trainer: the same log-probs, the same experts
        assert record["sampling/sampling_logp_difference/mean"] < 1e-5
        assert record["routing/replay_mismatch"] == 0
        assert record["frac_reward_zero_std"] < 1  # groups whose rewards differ: advantages to learn from
    assert len({r["reward"] for r in records}) == 3  # each batch drawn anew


def test_a_lora_loop_syncs_its_merged_weights(tmp_path, prompts):
    """LoRA: the engine gets the base with the adapters merged in each batch, so on-policy its log-probs
    are still the trainer's (adapters on), batch after batch, while the adapters learn."""
    records, _ = rl(tmp_path, "lora", prompts, *REFERENCE, "--train.steps=3", "--train.finetune=lora",
                    "--lora.rank=4", "--lora.targets=attention,routed_experts")
    assert all(r["sampling/sampling_logp_difference/mean"] < 1e-5 for r in records)
    assert all(r["routing/replay_mismatch"] == 0 for r in records) and len({r["reward"] for r in records}) == 3


@pytest.mark.slow
def test_the_loop_in_the_mop_layout_trains_like_one_process(tmp_path, reference, prompts):
    records, _ = rl(tmp_path, "mop", prompts, "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.expert=2",
                    "--parallel.vocab=2", "--parallel.expert_balance=llep", "--optim.offload=true",
                    "--train.activation_checkpointing=full", "--train.steps=3")
    assert np.allclose(picked(records), picked(reference[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ranks_available(1), reason="needs a GPU")
def test_the_loop_on_a_gpu_trains_like_on_the_cpu(tmp_path, reference, prompts):
    """The weights synced from the GPU to the CPU engine: the same rollouts, the same records (fp32; TF32
    off, the GPU's kernels within 1e-4)."""
    records, _ = rl(tmp_path, "gpu", prompts, *REFERENCE, "--train.device=cuda", "--train.steps=3")
    assert np.allclose(picked(records), picked(reference[0]), rtol=1e-4, atol=1e-5)


def test_a_resumed_loop_draws_and_trains_the_batches_it_would_have(tmp_path, prompts):
    straight, run_dir = rl(tmp_path, "straight", prompts, *REFERENCE, "--train.steps=4", "--checkpoint.every=2")
    # in another run directory: the rollouts drawn before the checkpoint are not there, nor needed
    resumed, _ = rl(tmp_path, "resumed", prompts, *REFERENCE, "--train.steps=4",
                    f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_2'}")
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose(picked(resumed), picked(straight[2:]), rtol=1e-6, atol=1e-7)


def test_off_policy_samples_each_batch_with_the_weights_one_update_earlier(tmp_path, prompts):
    records, _ = rl(tmp_path, "off", prompts, *REFERENCE, "--train.steps=3", "--rl.off_policy=true")
    drift = [r["sampling/sampling_logp_difference/mean"] for r in records]
    assert drift[0] < 1e-5  # batch 0 is sampled with the weights it trains
    assert min(drift[1:]) > 1e-3  # the later ones with the weights before the last update


def test_a_run_starts_from_another_runs_weights_at_step_0(tmp_path):
    text = [*MODEL, *REFERENCE, *QUIET, "--data.seq_len=32", "--train.global_batch=2", "--train.micro_batch=1"]
    assert main(["train", *text, "--train.steps=2", f"--log.run_dir={tmp_path / 'a'}"]) == 0
    start = tmp_path / "a" / "checkpoints" / "step_2"
    assert main(["train", *text, "--train.steps=1", "--optim.lr=0", "--optim.weight_decay=0",
                 f"--checkpoint.init={start}", f"--log.run_dir={tmp_path / 'b'}"]) == 0
    from mop.checkpoint import read_meta, read_tensors

    after = tmp_path / "b" / "checkpoints" / "step_1"
    assert read_meta(after)["step"] == 1
    shapes = {"embed.weight": torch.Size([259, 32]), "layers.1.mlp.experts.w_down": torch.Size([4, 32, 32])}
    torch.testing.assert_close(read_tensors(after, read_meta(after), shapes, set()),
                               read_tensors(start, read_meta(start), shapes, set()), rtol=0, atol=0)


def test_a_batch_is_padded_to_the_global_batch_with_sequences_that_train_nothing():
    from mop.data.rollouts.packing import padded_bounds

    bounds = np.array([0, 3, 5])
    assert padded_bounds(bounds, 4, 64).tolist() == [0, 3, 5, 5, 5]
    with pytest.raises(DataError, match="train.global_batch: the batch's rollouts fill 2 sequences"):
        padded_bounds(bounds, 1, 64)
    # a sequence of padding only adds nothing to the load-balancing loss (not 0 / 0)
    stats = RouterStats(torch.tensor([[2.0, 2.0], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                        torch.tensor([2.0, 0.0]))
    assert load_balancing_loss(stats).item() == 2 * (1 * 0.5 + 1 * 0.5)


@pytest.mark.parametrize("row, says", [
    ('{"prompt": "1+1="}', "row 1 is not an object with 'prompt' and 'answer'"),
    ('{"prompt": "", "answer": "2"}', "row 1's prompt is empty"),
    ('{"prompt": [{"role": "user", "content": "hi"}], "answer": "2"}', "row 1's prompt is messages"),
    ("not json", "row 1 is not valid JSON"),
])
def test_a_bad_prompt_row_is_one_line_naming_it(tmp_path, row, says):
    path = tmp_path / "p.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(DataError, match=f"rl.prompts: {path} {says}".replace("(", r"\(").replace(")", r"\)")):
        read_prompts(str(path), ByteTokenizer(), None)


@pytest.mark.parametrize("setting, says", [
    ("--rl.group=1", "rl.group: a prompt's advantages compare its group's rewards"),
    ("--rl.beta=0.1", "rl.reference: 'precomputed' covers recorded rollouts"),
    ("--rl.engine=vllm", "rl.engine_url: rl.engine = 'vllm' samples from a running server"),
    ("--data.seq_len=8", "data.seq_len: 8 cannot hold the longest prompt"),
    ("--train.global_batch=1", "train.global_batch: the batch's rollouts fill"),
])
def test_a_loop_it_cannot_run_is_one_line(tmp_path, prompts, capsys, setting, says):
    extra = ["--train.micro_batch=1"] if setting == "--train.global_batch=1" else []
    code = main(["rl", *LOOP, *REFERENCE, f"--rl.prompts={prompts}", "--train.steps=1",
                 f"--log.run_dir={tmp_path / 'run'}", setting, *extra])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_mop_rl_needs_prompts_and_mop_train_with_prompts_needs_rollouts(tmp_path, prompts, capsys):
    assert main(["rl", *MODEL, *REFERENCE, f"--log.run_dir={tmp_path}"]) == 2
    assert "rl.prompts: mop rl samples rollouts of prompts" in capsys.readouterr().err
    assert main(["train", *LOOP, *REFERENCE, f"--rl.prompts={prompts}", f"--log.run_dir={tmp_path}"]) == 2
    assert "data.format: 'text': the RL loop (rl.prompts) trains on the rollouts it samples" in capsys.readouterr().err
