"""mop's GRPO step equals TRL 1.16's on a tiny transformers Qwen3-MoE (issue 47): per-token log-probs
and entropies, the loss and the records, for each loss type, with the train-inference correction.

Setup: one tiny Qwen3-MoE (a dense first layer, then MoE layers) in fp32 with random O(1) weights
(`test_hf.hf_model`), saved as a Hugging Face checkpoint; mop loads it (`load_hf`). Three rollouts of
one prompt, as token ids with sampling log-probs (the model's own moved by noise, so the correction
corrects) and rewards: mop reads them as `data.format = "rollouts"` rows, packed into one sequence,
and runs its objective's micro-batch loss (`PolicyGradientLoss`, what `mop train`'s step runs); TRL
gets them as its padded batch (prompt, completion, completion mask) and runs its own
`GRPOTrainer._compute_loss` with its own fused LM head (`add_fused_lm_head`: log-probs and entropy
from the model) on the same model. The trainer is built without `__init__` (TRL's tests build it
without a model too); its advantages are mop's (`test_rollouts_data` compares those with TRL's
formula), its importance-sampling ratio TRL's formula on its old log-probs (`_generate_and_score_
completions`, sequence_mask). The MoE load-balancing loss is off on both sides.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from test_hf import hf_model

from mop.bench.grpo_trl import OneProcessAccelerator
from mop.config import RlConfig
from mop.data import build_data, count_targets
from mop.data.prepared import ChatSettings
from mop.data.rollouts.corpus import RolloutSettings
from mop.data.rollouts.rows import RouteShape
from mop.models.hf import load_hf
from mop.models.transformer import IGNORE_INDEX
from mop.objectives.policy_gradient.step import (
    BatchCache,
    PolicyGradientLoss,
    local_counts,
    step_counts,
    step_record,
)

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8]
COMPLETIONS = [[11, 12, 13, 14, 15, 16, 1], [21, 22, 23], [31, 32, 33, 34, 35]]
REWARDS = [1.0, 0.0, 0.5]
CLIP = (0.7, 1.6)  # the correction's bounds: the noise below puts rollouts on both sides
SEQ_LEN = 3 * len(PROMPT) + sum(map(len, COMPLETIONS))  # one sequence, no padding (the byte pad id is past the vocab)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = hf_model("qwen3_moe", seed=4)
    hf.config.router_aux_loss_coef = 0.0
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollouts(model_dir, tmp_path_factory):
    """The rows, their sampling log-probs the model's own plus noise (per rollout, so the sequence
    correction masks some)."""
    model = load_hf(model_dir).eval()
    generator = torch.Generator().manual_seed(2)
    rows = []
    for completion, reward, shift in zip(COMPLETIONS, REWARDS, (-0.12, 0.05, -0.02)):
        ids = torch.tensor([PROMPT + completion])
        with torch.no_grad():
            logps = model(ids)[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        own = logps[len(PROMPT) - 1:]
        sampling = own + shift + 0.02 * torch.randn(own.shape, generator=generator)
        rows.append({"prompt_ids": PROMPT, "completion_ids": completion, "sampling_logps": sampling.tolist(),
                     "reward": reward, "group": "q"})
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mop_step(model_dir, rollouts, rl: RlConfig) -> tuple[float, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mop's loss and record on the rollouts, and its per-token log-probs and entropies with the
    advantages, in rollout order."""
    model = load_hf(model_dir)
    cfg = model.cfg
    data = build_data(str(rollouts), "byte", SEQ_LEN, 0, chat=ChatSettings("byte", kind="rollouts"),
                      rollouts=RolloutSettings(RouteShape(cfg.layers, cfg.dense_layers, cfg.experts, cfg.top_k)))
    assert len(data.dataset) == 1
    batch = {key: value.unsqueeze(0) for key, value in data.dataset[0].items()}
    counts = step_counts(count_targets([batch]), local_counts([batch]))
    moe_layers = cfg.layers - cfg.dense_layers
    objective = PolicyGradientLoss(model, rl, counts, 1, data.dataset.rollouts_max, "off", moe_layers, 0,
                                   BatchCache(says=False))
    loss, parts, _ = objective(batch)
    record = step_record(parts.tolist(), objective.parts, counts, moe_layers)
    terms = model.policy_terms(batch["input_ids"], batch["labels"], batch["position_ids"], batch["document_ids"])
    # the packed rollouts' tokens in the rows' order: each rollout's generated tokens, in sequence order
    generated = batch["labels"][0] != IGNORE_INDEX
    row_of = torch.as_tensor(data.dataset.packing.items)  # the packing's order of the rows
    order = row_of[batch["rollout_ids"][0][generated]].argsort(stable=True)
    values = (terms.logps[0][generated][order], terms.entropy[0][generated][order],
              batch["advantages"][0][generated][order])
    return float(loss), record, *values


def trl_step(model_dir, rollouts_path, rl: RlConfig, advantages: torch.Tensor):
    """TRL's `_compute_loss` on the rows as its padded batch, with its fused head on the model."""
    hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32)
    add_fused_lm_head(hf, outputs=("log_probs", "entropy"))
    rows = [json.loads(line) for line in open(rollouts_path)]
    length = max(len(r["completion_ids"]) for r in rows)
    completion_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    sampling = torch.zeros(len(rows), length)
    for i, row in enumerate(rows):
        n = len(row["completion_ids"])
        completion_ids[i, :n], mask[i, :n] = torch.tensor(row["completion_ids"]), 1
        sampling[i, :n] = torch.tensor(row["sampling_logps"])
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=rl.importance_sampling_level,
        beta=rl.beta, loss_type=rl.loss_type, epsilon_low=rl.epsilon, epsilon_high=rl.epsilon_high or rl.epsilon,
        use_vllm=True, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=rl.max_completion_length,
        accelerator=OneProcessAccelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=rl.kl_bias_correction, delta=rl.delta or None,
                             steps_per_generation=1))
    prompt_ids = torch.tensor([PROMPT] * len(rows))
    prompt_mask = torch.ones_like(prompt_ids)
    with torch.no_grad():  # TRL's old log-probs: a no-grad pass at generation time
        old, _, _ = trainer._get_per_token_logps_and_entropies(
            hf, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1), length)
    # TRL's correction (`_generate_and_score_completions`, sequence_mask)
    rho = torch.nan_to_num((old - sampling) * mask, nan=0.0).sum(-1, keepdim=True).exp()
    rho = rho.masked_fill((rho < CLIP[0]) | (rho > CLIP[1]), 0.0)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": mask, "advantages": advantages, "old_per_token_logps": old,
              "importance_sampling_ratio": rho, "num_items_in_batch": mask.sum()}
    loss = trainer._compute_loss(hf, inputs)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            hf, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1), length,
            compute_entropy=True)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    kept = mask.bool()
    return float(loss), metrics, logps[kept], entropies[kept], rho


CASES = [(loss_type, "token") for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")] + [("grpo", "sequence")]
CASES += [pytest.param(loss_type, "sequence", marks=pytest.mark.slow)
          for loss_type in ("dr_grpo", "dapo", "bnpo", "cispo")]


@pytest.mark.parametrize("loss_type, level", CASES)
def test_grpo_step_equals_trls(model_dir, rollouts, loss_type, level):
    rl = RlConfig(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2,
                  epsilon_high=5.0 if loss_type == "cispo" else 0.28, max_completion_length=8,
                  correction="sequence_mask", correction_min=CLIP[0], correction_max=CLIP[1])
    loss, record, logps, entropy, advantages = mop_step(model_dir, rollouts, rl)
    per_rollout = torch.stack([advantages[0], advantages[len(COMPLETIONS[0])],
                               advantages[len(COMPLETIONS[0]) + len(COMPLETIONS[1])]])
    their_loss, metrics, their_logps, their_entropy, rho = trl_step(model_dir, rollouts, rl, per_rollout)
    assert ((rho == 0).sum(), (rho > 0).sum()) == (1, 2)  # the correction masks one rollout, keeps two
    torch.testing.assert_close(logps, their_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, their_entropy, rtol=1e-5, atol=1e-5)
    assert loss == pytest.approx(their_loss, rel=1e-5, abs=1e-7)
    compared = [k for k in metrics if k.endswith("_mean") or k in ("entropy", "cispo_clip_ratio")]
    assert compared and set(compared) <= set(record)
    for key in compared:
        assert record[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
