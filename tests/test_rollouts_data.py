"""Recorded rollouts (issue 47): rows read into a `RolloutCorpus` (`mop.data.rollouts.corpus`) and packed whole
into training sequences (`mop.data.rollouts.packing`), through `load_dataset(..., rollouts=...)`.

Proven here:
- token-id rows: the prompt is context, the completion's generated tokens (`completion_mask` 1) are the
  targets, tool output inside the completion (mask 0) never is; `sampling_logps` land on the generated
  tokens in order (null: NaN), an advantage (one number or one per generated token) on those tokens only;
- packed, 3 rollouts in one sequence plus padding: each generated token is the label of the position
  before it, and that position carries its advantage, sampling log-prob, rollout number, the rollout's
  generated-token count; each rollout's first such position its reward and zero-std flag; routes are
  the input token's own (no shift), -1 on a rollout without routes and on padding;
- messages rows rendered with the shipped Qwen3 template give `ChatTemplate.encode`'s ids of the whole
  conversation, the completion's assistant tokens as targets and a tool message inside it as context;
- advantages from rewards equal TRL 1.16's `_generate_and_score_completions` (its `nanstd`, its formula
  copied below) for scale_rewards group, batch and none, with an unscorable reward, a group of one
  scorable reward, a zero-std group, rows in any order (mop groups by name, TRL by position);
- routed experts give the same routes in every accepted form: nested lists with all layers (the dense
  layer's rows ignored) or the MoE layers only, base64 `.npy` (uint8 and uint16, vLLM's HTTP form), base64
  raw little-endian int32 (SGLang), rows from `routed_experts_start` on (-1 before; the last token none);
- a bad row is one line naming its file and row, or with `skip_invalid` counted and skipped;
- a rollout longer than seq_len is dropped and counted in `dataset.stats`.
SGLang's int32 of the MoE layers only is read whichever layer counts its length divides by, and a row
mixing advantages and rewards is skipped with `skip_invalid`.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import mop
from mop.data.errors import DataError
from mop.data.loader import load_dataset
from mop.data.prepared import ChatSettings
from mop.data.rollouts.corpus import RolloutSettings, group_advantages, read_rollouts
from mop.data.rollouts.rows import RolloutRows, RouteShape
from mop.data.templates import Conversation
from mop.data.tokenizer import ByteTokenizer, load_tokenizer

QWEN3 = str(Path(mop.__file__).parent / "data" / "assets" / "qwen3")
IGNORE = -100
SHAPE = RouteShape(layers=3, dense_layers=1, experts=8, top_k=2)
BYTES = ByteTokenizer()


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def corpus_of(path: str, scale: str = "group", skip_invalid: bool = False, shape: RouteShape = SHAPE):
    return read_rollouts(path, RolloutRows(BYTES, None, shape), scale, skip_invalid)


def dataset_of(path: str, seq_len: int, scale: str = "group", skip_invalid: bool = False, tokenizer: str = "byte",
               shape: RouteShape = SHAPE):
    chat = ChatSettings(tokenizer, skip_invalid=skip_invalid, kind="rollouts")
    return load_dataset(path, load_tokenizer(tokenizer), seq_len, seed=3, chat=chat,
                        rollouts=RolloutSettings(shape, scale))


def routes(tokens: int, seed: int, shape: RouteShape = SHAPE) -> np.ndarray:
    """MoE-layer routes `[tokens - 1, moe_layers, top_k]` as an engine records them: k distinct experts."""
    scores = np.random.default_rng(seed).random((tokens - 1, shape.moe_layers, shape.experts))
    return np.argsort(scores, axis=-1)[..., :shape.top_k]


def all_layers(moe: np.ndarray, shape: RouteShape = SHAPE) -> np.ndarray:
    """The engines' form: a row per decoder layer, the dense layers' zeros first."""
    dense = np.zeros((len(moe), shape.dense_layers, shape.top_k), dtype=moe.dtype)
    return np.concatenate([dense, moe], axis=1)


# Three rollouts: A with a tool result inside its completion (mask 0) and a null sampling log-prob, one
# advantage for the whole completion and routes; B per-token advantages, no routes; C no log-probs.
ROW_A = {"prompt_ids": [10, 11, 12], "completion_ids": [20, 21, 22, 23], "completion_mask": [1, 1, 0, 1],
         "sampling_logps": [-0.5, None, -1.5], "advantage": 0.75, "routed_experts": routes(7, 0).tolist()}
ROW_B = {"prompt_ids": [30, 31], "completion_ids": [40, 41], "sampling_logps": [-1.0, -2.0], "advantage": [1.0, -2.0]}
ROW_C = {"prompt_ids": [50], "completion_ids": [60, 61, 62], "advantage": [0.25, 0.5, 0.125],
         "routed_experts": all_layers(routes(4, 1)).tolist()}
# Each row's (generated mask over prompt + completion, advantage and sampling log-prob per token, routes).
EXPECTED = {
    10: ([0, 0, 0, 1, 1, 0, 1], [0, 0, 0, .75, .75, 0, .75], [np.nan] * 3 + [-.5, np.nan, np.nan, -1.5], routes(7, 0)),
    30: ([0, 0, 1, 1], [0, 0, 1, -2], [np.nan, np.nan, -1, -2], None),
    50: ([0, 1, 1, 1], [0, .25, .5, .125], [np.nan] * 4, routes(4, 1)),
}


def test_token_id_rows_encode_targets_logps_and_advantages(tmp_path):
    corpus = corpus_of(write_rows(tmp_path / "r.jsonl", [ROW_A, ROW_B, ROW_C]))
    assert len(corpus) == 3 and corpus.skipped == 0
    np.testing.assert_array_equal(corpus.offsets, [0, 7, 11, 15])
    np.testing.assert_array_equal(corpus.prompts, [3, 2, 1])
    np.testing.assert_array_equal(corpus.tokens, [10, 11, 12, 20, 21, 22, 23, 30, 31, 40, 41, 50, 60, 61, 62])
    for k, first in enumerate((10, 30, 50)):
        generated, advantages, logps, moe = EXPECTED[first]
        part = slice(corpus.offsets[k], corpus.offsets[k + 1])
        np.testing.assert_array_equal(corpus.targets[part], np.array(generated, dtype=bool))
        np.testing.assert_array_equal(corpus.advantages[part], np.array(advantages, dtype=np.float32))
        np.testing.assert_array_equal(corpus.sampling[part], np.array(logps, dtype=np.float32))  # NaN == NaN here
        expected_routes = np.full((part.stop - part.start, 2, 2), -1)
        if moe is not None:
            expected_routes[:-1] = moe
        np.testing.assert_array_equal(corpus.routes[part], expected_routes)
    assert not corpus.targets[5]  # the tool output token 22: context
    assert np.isnan(corpus.rewards).all() and not corpus.zero_std.any()
    assert corpus.routes.dtype == np.int16 and corpus.sampling.dtype == corpus.advantages.dtype == np.float32


def expected_row(input_ids: np.ndarray, seq_len: int) -> dict:
    """The packed row of ROW_A, ROW_B and ROW_C (advantages: no reward, std never 0) rebuilt from EXPECTED,
    each rollout found by its first token in the sequence."""
    out = {"labels": np.full(seq_len, IGNORE), "advantages": np.zeros(seq_len),
           "sampling_logps": np.full(seq_len, np.nan),
           "rollout_ids": np.full(seq_len, -1), "rollout_tokens": np.zeros(seq_len),
           "rollout_starts": np.zeros(seq_len, bool), "rewards": np.full(seq_len, np.nan),
           "zero_std": np.zeros(seq_len, bool), "routes": np.full((seq_len, 2, 2), -1)}
    at = 0
    for j in range(3):
        first = int(input_ids[at])
        generated, advantages, logps, moe = EXPECTED[first]
        n = len(generated)
        for t in range(n - 1):  # position at + t predicts token t + 1
            if generated[t + 1]:
                out["labels"][at + t] = input_ids[at + t + 1]
                out["advantages"][at + t] = advantages[t + 1]
                out["sampling_logps"][at + t] = logps[t + 1]
                out["rollout_ids"][at + t] = j
                out["rollout_tokens"][at + t] = sum(generated)
        start = at + generated.index(1) - 1
        out["rollout_starts"][start] = True
        if moe is not None:
            out["routes"][at:at + n - 1] = moe  # token t's own routes; the last token has none
        at += n
    return out


def test_packed_row_puts_every_value_at_its_position(tmp_path):
    dataset = dataset_of(write_rows(tmp_path / "r.jsonl", [ROW_A, ROW_B, ROW_C]), seq_len=20)
    assert len(dataset) == 1 and dataset.stats["data_rollouts"] == 3
    row = dataset[0]
    ids = row["input_ids"].numpy()
    starts = np.flatnonzero(np.diff(row["document_ids"].numpy(), prepend=-1))
    assert sorted(ids[starts[:3]].tolist()) == [10, 30, 50] and len(starts) == 4  # 3 rollouts, then padding
    np.testing.assert_array_equal(ids[15:], BYTES.pad_id)
    np.testing.assert_array_equal(row["padding"].numpy(), np.arange(20) >= 15)
    expected = expected_row(ids, 20)
    for key, value in expected.items():
        np.testing.assert_array_equal(row[key].numpy(), value, err_msg=key)
    assert row["routes"].dtype == torch.int16 and row["sampling_logps"].dtype == torch.float32
    # literally, for rollout A: its tool token 22 is no label, its first generated token 20 is the prompt's last's
    a = int(np.flatnonzero(ids == 10)[0])
    assert row["labels"][a + 2] == 20 and row["labels"][a + 4] == IGNORE and row["labels"][a + 5] == 23
    assert row["advantages"][a + 4] == 0 and row["rollout_starts"][a + 2] and row["rollout_tokens"][a + 2] == 3
    np.testing.assert_array_equal(row["routes"][a].numpy(), routes(7, 0)[0])  # token 10's own, not token 11's


def test_packed_rewards_and_zero_std_at_each_rollouts_start(tmp_path):
    rows = [dict(ROW_A, advantage=None, reward=1.0, group="p"), dict(ROW_B, advantage=None, reward=0.0, group="p"),
            dict(ROW_C, advantage=None, reward=2.0, group="q"),
            {"prompt_ids": [70], "completion_ids": [71], "reward": 2.0, "group": "q"}]  # q: std 0
    row = dataset_of(write_rows(tmp_path / "r.jsonl", rows), seq_len=20)[0]
    ids, rollout_ids = row["input_ids"].numpy(), row["rollout_ids"].numpy()
    value = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-4)
    expected = {10: (value, 1.0, False), 30: (-value, 0.0, False), 50: (0.0, 2.0, True), 70: (0.0, 2.0, True)}
    for first, (advantage, reward, zero_std) in expected.items():
        k = int(np.flatnonzero(ids == first)[0])
        mine = rollout_ids == rollout_ids[k:][rollout_ids[k:] >= 0][0]  # its labelled positions
        assert mine[:k].sum() == 0 and (row["labels"].numpy()[mine] != IGNORE).all()
        np.testing.assert_allclose(row["advantages"].numpy()[mine], advantage, rtol=1e-6)
        start = int(np.flatnonzero(mine)[0])
        assert row["rollout_starts"][start] and row["rollout_starts"].numpy()[mine].sum() == 1
        assert row["rewards"][start] == reward and bool(row["zero_std"][start]) == zero_std
    starts = row["rollout_starts"].numpy()
    assert starts.sum() == 4 and np.isnan(row["rewards"].numpy()[~starts]).all() and not row["zero_std"][~starts].any()
    assert (row["advantages"].numpy()[rollout_ids < 0] == 0).all()


def test_messages_rows_render_with_the_chat_template(tmp_path):
    prompt = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Earlier answer."},
              {"role": "user", "content": "What is 6 times 7?"}]  # the prompt's own assistant turn: context
    completion = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                      "name": "calculator", "arguments": {"a": 6, "b": 7}}}]},
                  {"role": "tool", "content": "forty-two from the tool"},
                  {"role": "assistant", "content": "It is 42."}]
    template = ChatSettings(QWEN3).template()
    ids, targets = template.encode(Conversation(prompt + completion))
    prompt_ids = template.encode_prompt(Conversation(prompt))
    generated = int(targets[len(prompt_ids):].sum())
    logps = [-0.01 * (i + 1) for i in range(generated)]
    rows = [{"prompt": prompt, "completion": completion, "sampling_logps": logps, "advantage": 1.5}]
    dataset = dataset_of(write_rows(tmp_path / "r.jsonl", rows), seq_len=128, tokenizer=QWEN3)
    corpus = dataset.corpus
    np.testing.assert_array_equal(corpus.tokens, ids)
    assert corpus.prompts[0] == len(prompt_ids) and np.array_equal(ids[:len(prompt_ids)], prompt_ids)
    expected = np.array(targets, dtype=bool)
    expected[:len(prompt_ids)] = False
    np.testing.assert_array_equal(corpus.targets, expected)
    tok = template.tokenizer
    said = tok.decode(corpus.tokens[corpus.targets], special=True)
    assert "It is 42." in said and '"name": "calculator"' in said and "forty-two" not in said
    assert "Earlier answer." not in said and targets[:len(prompt_ids)].any()  # encode's targets there, not ours
    assert "forty-two from the tool" in tok.decode(corpus.tokens, special=True)
    np.testing.assert_allclose(corpus.sampling[corpus.targets], logps, rtol=1e-6)
    assert np.isnan(corpus.sampling[~corpus.targets]).all()
    np.testing.assert_array_equal(corpus.advantages, np.where(expected, 1.5, 0).astype(np.float32))
    row = dataset[0]
    n = len(ids)
    np.testing.assert_array_equal(row["labels"].numpy()[:n - 1], np.where(expected[1:], ids[1:], IGNORE))
    assert row["rollout_tokens"].max() == generated == int(expected.sum())


def test_messages_rows_need_a_template(tmp_path):
    path = write_rows(tmp_path / "r.jsonl", [{"prompt": [{"role": "user", "content": "hi"}],
                                              "completion": [{"role": "assistant", "content": "yo"}], "advantage": 1}])
    with pytest.raises(DataError, match="rendered with a chat template"):
        corpus_of(path)


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str):
    """TRL 1.16 `GRPOTrainer._generate_and_score_completions`, sum_then_normalize, its lines copied."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return advantages.numpy(), is_std_zero.numpy()


# Groups of 3 (TRL's order): spread; one unscorable; one scorable reward only; all equal (std 0).
REWARDS = [1.0, 0.0, 0.5, None, 2.0, 1.0, None, None, 3.0, 1.0, 1.0, 1.0]
GROUPS = [name for name in "abcd" for _ in range(3)]


@pytest.mark.parametrize("rewards", [REWARDS, [2.0] * 6 + [None] * 3], ids=["mixed", "constant"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trls(tmp_path, scale, rewards):
    values = np.array([np.nan if r is None else r for r in rewards])
    groups = GROUPS[:len(rewards)]
    want, want_zero = trl_advantages(torch.tensor(values, dtype=torch.float32), 3, scale)
    got, got_zero = group_advantages(values, groups, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_zero, want_zero)
    assert want_zero.any() or scale == "batch"  # the zero-std flag is exercised
    # the source is the batch, its rows in any order: read back through read_rollouts
    order = np.random.default_rng(0).permutation(len(rewards))
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "completion_mask": [1, 0, 1], "reward": rewards[k],
             "group": groups[k]} for k in order]
    corpus = corpus_of(write_rows(tmp_path / "r.jsonl", rows), scale=scale)
    per_rollout = corpus.advantages.reshape(len(rewards), 5)
    np.testing.assert_allclose(per_rollout[:, [2, 4]], np.repeat(want[order, None], 2, 1), rtol=1e-5, atol=1e-5)
    assert (per_rollout[:, [0, 1, 3]] == 0).all()  # prompt and tool tokens carry none
    np.testing.assert_array_equal(corpus.zero_std, want_zero[order])
    np.testing.assert_array_equal(corpus.rewards, values[order])


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def npy_base64(array: np.ndarray) -> str:
    return base64.b64encode(npy_bytes(array)).decode()


def route_forms(moe: np.ndarray, dtype) -> dict:
    """Every accepted form of the same recorded routes (`[tokens - 1, moe_layers, top_k]`)."""
    full = all_layers(moe)
    return {"lists, all layers": full.tolist(), "lists, MoE layers": moe.tolist(),
            "vLLM .npy, all layers": npy_base64(full.astype(dtype)),
            "vLLM .npy, MoE layers": npy_base64(moe.astype(dtype)),
            "SGLang int32": sglang_base64(full)}


@pytest.mark.parametrize("dtype,experts", [(np.uint8, 8), (np.uint16, 300)])
def test_routed_experts_forms_agree(tmp_path, dtype, experts):
    shape = RouteShape(layers=3, dense_layers=1, experts=experts, top_k=2)
    moe = routes(6, 7, shape)
    assert dtype == np.uint8 or moe.max() > 255  # uint16 ids beyond a byte
    base = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6], "advantage": 1.0}
    forms = route_forms(moe, dtype)
    rows = [dict(base, routed_experts=value) for value in forms.values()]
    rows.append(dict(base, routed_experts=all_layers(moe)[2:].tolist(), routed_experts_start=2))
    rows.append(dict(base, routed_experts=npy_base64(moe[3:].astype(dtype)), routed_experts_start=3))
    rows[0]["routed_experts"][0][0] = [7, 7]  # a dense layer's row is ignored, whatever it holds
    corpus = corpus_of(write_rows(tmp_path / "r.jsonl", rows), shape=shape)
    every = corpus.routes.reshape(len(rows), 6, 2, 2)
    expected = np.full((6, 2, 2), -1)
    expected[:5] = moe
    for name, got in zip(forms, every):
        np.testing.assert_array_equal(got, expected, err_msg=name)
    for start, got in ((2, every[-2]), (3, every[-1])):
        np.testing.assert_array_equal(got[start:], expected[start:])
        assert (got[:start] == -1).all()


def sglang_base64(moe: np.ndarray) -> str:
    return base64.b64encode(moe.astype("<i4").tobytes()).decode()


def test_sglang_int32_of_moe_layers_only(tmp_path):
    moe = routes(6, 2)  # 5 rows x 2 MoE layers x top_k 2 = 20 int32: not a multiple of 3 layers x 2
    row = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6], "advantage": 1.0, "routed_experts": sglang_base64(moe)}
    np.testing.assert_array_equal(corpus_of(write_rows(tmp_path / "r.jsonl", [row])).routes[:5], moe)


def test_sglang_int32_of_moe_layers_only_when_all_layers_also_divide(tmp_path):
    moe = routes(4, 2)  # 3 rows x 2 MoE layers x top_k 2 = 12 int32, also 2 rows x 3 layers x 2
    row = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "advantage": 1.0, "routed_experts": sglang_base64(moe)}
    np.testing.assert_array_equal(corpus_of(write_rows(tmp_path / "r.jsonl", [row])).routes[:3], moe)


GOOD = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6], "advantage": 1.0}
BAD = {
    "sampling_logps length": (dict(GOOD, sampling_logps=[-1.0, -2.0]), "'sampling_logps' has 2 values for 3 generated"),
    "completion_mask length": (dict(GOOD, completion_mask=[1, 1]), "'completion_mask' has 2 values for 3"),
    "per-token advantage length": (dict(GOOD, advantage=[1.0, 2.0, 3.0, 4.0]), "'advantage' has 4 values for 3"),
    "mask shortens the targets": (dict(GOOD, completion_mask=[1, 0, 1], sampling_logps=[-1.0, -1.0, -1.0]),
                                  "'sampling_logps' has 3 values for 2"),
    "route rows": (dict(GOOD, routed_experts=routes(5, 0).tolist()), "'routed_experts' has 4 rows from token 0 for 6"),
    "expert id": (dict(GOOD, routed_experts=np.full((5, 2, 2), 8).tolist()), "expert id outside [0, 8)"),
    "negative expert id": (dict(GOOD, routed_experts=np.full((5, 3, 2), -1).tolist()), "expert id outside [0, 8)"),
    "an expert twice": (dict(GOOD, routed_experts=np.full((5, 2, 2), 3).tolist()), "names an expert twice"),
    "layer count": (dict(GOOD, routed_experts=np.zeros((5, 4, 2), int).tolist()),
                    "'routed_experts' has shape [5, 4, 2]"),
    "top-k": (dict(GOOD, routed_experts=npy_base64(np.zeros((5, 2, 3), np.uint8))), "has shape [5, 2, 3]"),
    "int32 count": (dict(GOOD, routed_experts=base64.b64encode(np.zeros(7, "<i4").tobytes()).decode()),
                    "base64 of 28 bytes that are neither a .npy file (no .npy header) nor raw int32 of its 5 routed "
                    "tokens (tokens - 1 - routed_experts_start) x layers x top_k 2: 120 bytes (3 layers) or 80 "
                    "bytes (2 layers); send vLLM's .npy or SGLang's raw little-endian int32"),
    # issue 64: payloads that are neither form, read as what they are
    "not npy, odd length": (dict(GOOD, routed_experts=base64.b64encode(b"hello").decode()),
                            "base64 of 5 bytes that are neither a .npy file"),
    "not npy, a multiple of 4": (dict(GOOD, routed_experts=base64.b64encode(b"PK\x03\x04" * 5).decode()),
                                 "base64 of 20 bytes that are neither a .npy file"),
    "npy cut short": (dict(GOOD, routed_experts=base64.b64encode(npy_bytes(routes(6, 0))[:-7]).decode()),
                      "'routed_experts' is a .npy file that cannot be read, cut short or corrupt"),
    "npy header cut": (dict(GOOD, routed_experts=base64.b64encode(npy_bytes(routes(6, 0))[:20]).decode()),
                       "'routed_experts' is a .npy file that cannot be read, cut short or corrupt"),
    "npy of floats": (dict(GOOD, routed_experts=npy_base64(routes(6, 0).astype(np.float32))),
                      "is a .npy of float32, not of integer expert ids"),
    "route start past the tokens": (dict(GOOD, routed_experts=[], routed_experts_start=6),
                                    "'routed_experts_start' is not a token index of its 6 tokens (6)"),
    "log-prob above 0": (dict(GOOD, sampling_logps=[-1.0, 0.7, -0.5]),
                         "'sampling_logps' holds 0.7 for generated token 1: a log-probability is at most 0 "
                         "(rounding allowed to 0.001)"),
    "NaN log-prob": (dict(GOOD, sampling_logps=[-1.0, float("nan"), None]),
                     "'sampling_logps' holds a non-finite value (nan); an unknown value is null"),
    "infinite log-prob": (dict(GOOD, sampling_logps=[float("-inf"), -1.0, -1.0]),
                          "'sampling_logps' holds a non-finite value (-inf)"),
    "infinite advantage": (dict(GOOD, advantage=float("inf")), "'advantage' is not finite"),
    "NaN advantage": (dict(GOOD, advantage=float("nan")), "'advantage' is not finite"),
    "NaN reward": ({**GOOD, "advantage": None, "reward": float("nan"), "group": "g"}, "'reward' is not a finite"),
    "non-finite per-token advantage": (dict(GOOD, advantage=[1.0, float("-inf"), 1.0]), "non-finite"),
    "infinite reward": ({**GOOD, "advantage": None, "reward": float("inf"), "group": "g"}, "'reward' is not a finite"),
    "token id": (dict(GOOD, completion_ids=[4, 5, 259]), "'completion_ids' holds a value that is not a token id"),
    "negative token id": (dict(GOOD, prompt_ids=[-1, 2, 3]), "'prompt_ids' holds a value that is not a token id"),
    "no signal": ({"prompt_ids": [1], "completion_ids": [2]}, "neither an 'advantage' nor a 'reward' with a 'group'"),
    "reward without group": ({"prompt_ids": [1], "completion_ids": [2], "reward": 1.0}, "neither an 'advantage'"),
    "no generated token": (dict(GOOD, completion_mask=[0, 0, 0]), "no generated token"),
}


def test_sampling_log_probs_a_rounding_above_zero_and_null_are_read(tmp_path):
    row = dict(GOOD, sampling_logps=[-0.5, 1e-3, None])  # a near-certain token's fp32 rounding, one unknown
    corpus = corpus_of(write_rows(tmp_path / "r.jsonl", [row]))
    np.testing.assert_array_equal(corpus.sampling[corpus.targets], np.array([-0.5, 1e-3, np.nan], np.float32))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_one_has_zero_std_as_trls_one_generation(tmp_path, scale):
    values = np.array([1.0, 0.0, 2.0, np.nan])
    want, want_zero = trl_advantages(torch.tensor(values, dtype=torch.float32), 1, scale)
    got, got_zero = group_advantages(values, ["a", "b", "c", "d"], scale)
    np.testing.assert_allclose(got, want, atol=0)
    np.testing.assert_array_equal(got_zero, want_zero)
    assert got_zero.all() or scale == "batch"
    rows = [{"prompt_ids": [1], "completion_ids": [2], "reward": 1.0, "group": g} for g in ("p", "p", "q", "r", "p")]
    assert corpus_of(write_rows(tmp_path / "r.jsonl", rows), scale=scale).lone_groups == ("q", "r")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_row_is_one_line_naming_file_and_row(tmp_path, name):
    bad, reason = BAD[name]
    path = write_rows(tmp_path / "r.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError) as caught:
        corpus_of(path)
    message = str(caught.value)
    assert message.startswith(f"data.source: {path} row 2: ") and "\n" not in message
    assert reason in message and "data.skip_invalid" in message


def test_mixed_advantages_and_rewards_are_refused(tmp_path):
    reward = {**GOOD, "advantage": None, "reward": 1.0, "group": "g"}
    path = write_rows(tmp_path / "r.jsonl", [GOOD, GOOD, reward])
    with pytest.raises(DataError, match=rf"^data.source: {path} row 3: it gives a reward where the source's first"):
        corpus_of(path)
    path = write_rows(tmp_path / "s.jsonl", [reward, GOOD])
    with pytest.raises(DataError, match=r"row 2: it gives an advantage where"):
        corpus_of(path)


def test_skip_invalid_counts_and_skips_bad_rows(tmp_path):
    rows = [GOOD, *(bad for bad, _ in BAD.values()), dict(GOOD, prompt_ids=[9, 9])]
    path = write_rows(tmp_path / "r.jsonl", rows)
    corpus = corpus_of(path, skip_invalid=True)
    assert corpus.skipped == len(BAD) and len(corpus) == 2
    np.testing.assert_array_equal(corpus.tokens, [1, 2, 3, 4, 5, 6, 9, 9, 4, 5, 6])
    dataset = dataset_of(path, seq_len=8, skip_invalid=True)
    assert dataset.stats["data_skipped_invalid"] == len(BAD) and dataset.stats["data_rollouts"] == 2


def test_skip_invalid_skips_a_row_mixing_signals(tmp_path):
    reward = {**GOOD, "advantage": None, "reward": 1.0, "group": "g"}
    corpus = corpus_of(write_rows(tmp_path / "r.jsonl", [GOOD, reward, GOOD]), skip_invalid=True)
    assert corpus.skipped == 1 and len(corpus) == 2


def test_overlong_rollout_is_dropped_and_counted(tmp_path):
    long = dict(GOOD, completion_ids=list(range(20, 36)))  # 19 tokens
    rows = [GOOD, long, dict(GOOD, prompt_ids=[7])]  # 6, 19 and 4 tokens
    dataset = dataset_of(write_rows(tmp_path / "r.jsonl", rows), seq_len=10)
    assert dataset.stats["data_overlong_dropped"] == 1 and dataset.stats["data_rollouts"] == 2
    assert dataset.stats["data_overlong_truncated"] == 0 and dataset.stats["data_skipped_invalid"] == 0
    sequences = [dataset[i] for i in range(len(dataset))]
    ids = torch.cat([s["input_ids"] for s in sequences])
    assert not torch.isin(ids, torch.arange(20, 36)).any() and (ids == 7).sum() == 1
    assert sum(int(s["rollout_starts"].sum()) for s in sequences) == 2
    with pytest.raises(DataError, match=r"no rollout fits data.seq_len = 3 \(3 dropped"):
        dataset_of(write_rows(tmp_path / "s.jsonl", rows), seq_len=3)


@pytest.mark.parametrize("routed", [False, True], ids=["no-routes", "routes"])
def test_a_run_warns_once_of_a_group_of_one_and_records_the_replay_chosen(tmp_path, capfd, routed):
    from mop.cli import main
    from mop.metrics import read_metrics
    from test_train import TINY

    recorded = {"routed_experts": [[[0, 1], [2, 3]]] * 4} if routed else {}  # TINY: 2 MoE layers, top-2 of 4
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "reward": reward, "group": group, **recorded}
            for reward, group in ((1.0, "p"), (0.0, "p"), (1.0, "lonely"))]
    source, run_dir = write_rows(tmp_path / "r.jsonl", rows), tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--data.format=rollouts", f"--data.source={source}",
                 f"--log.run_dir={run_dir}"]) == 0
    warned = [line for line in capfd.readouterr().err.splitlines() if "hold one rollout" in line]
    assert warned == ["mop: warning: 1 group(s) of the rollouts hold one rollout (the first: group 'lonely'): its "
                      "advantage is 0, so it trains nothing but the KL, and it counts in frac_reward_zero_std; "
                      "sample 2 or more rollouts per prompt (TRL refuses fewer than 2 generations)"]
    assert read_metrics(run_dir / "metrics.jsonl")[0]["frac_reward_zero_std"] == pytest.approx(1 / 3)
    replay = json.loads((run_dir / "config.json").read_text())["rl"]["replay"]  # "auto", decided
    assert replay == ("rollout" if routed else "off")
