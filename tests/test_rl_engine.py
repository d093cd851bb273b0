"""The CPU inference engine of the RL loop (issue 48, `mop.rl.engine.TransformersEngine`): the rollouts
it samples from a Hugging Face folder are rows mop's rollout reader takes, their sampling log-probs are
the trainer's log-probs of the same tokens under the same weights, and their routed experts are the
ones the trainer's routers choose (replaying them mismatches no token), for transformers' Qwen3-MoE
(a dense first layer) and Mixtral with random O(1) weights."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf import hf_model

from mop.data.rollouts.corpus import read_rollouts
from mop.data.rollouts.rows import RolloutRows, RouteShape
from mop.data.tokenizer import ByteTokenizer
from mop.models.hf import load_hf
from mop.rl.engine import TransformersEngine

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 99, 3], [42, 8, 11]]
EOS = 1


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_engine_rollouts_are_the_trainers_view_of_the_same_weights(tmp_path, case):
    hf_model(case, seed=3).save_pretrained(tmp_path / "weights")
    engine = TransformersEngine(eos_id=EOS)
    engine.load(tmp_path / "weights")
    rows = engine.sample(PROMPTS, group=3, max_new_tokens=6, seed=0)
    assert [r["prompt_ids"] for r in rows] == [p for p in PROMPTS for _ in range(3)]
    assert len({tuple(r["completion_ids"]) for r in rows}) > 2  # sampled, not greedy
    model = load_hf(tmp_path / "weights")
    cfg = model.cfg
    shape = RouteShape(cfg.layers, cfg.dense_layers, cfg.experts, cfg.top_k)
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
        labels[:, :len(row["prompt_ids"]) - 1] = -100
        routes = torch.tensor(row["routed_experts"])[:, cfg.dense_layers:]
        forced = torch.cat([routes, torch.full((1, *routes.shape[1:]), -1)]).unsqueeze(0)
        with torch.no_grad():
            terms = model.policy_terms(ids, labels, routes=forced)
        mine = terms.logps[0, len(row["prompt_ids"]) - 1:-1]
        torch.testing.assert_close(mine, torch.tensor(row["sampling_logps"]), rtol=1e-5, atol=1e-5)
        mismatched, replayed = terms.replay.sum(0).tolist()
        assert mismatched == 0 and replayed == (ids.shape[1] - 1) * (cfg.layers - cfg.dense_layers)
    source = tmp_path / "rollouts.jsonl"
    source.write_text("".join(json.dumps({**r, "reward": 1.0, "group": r["prompt_ids"][0]}) + "\n" for r in rows))
    corpus = read_rollouts(str(source), RolloutRows(ByteTokenizer(), None, shape), "group", False)
    assert len(corpus) == len(rows) and corpus.routes is not None
