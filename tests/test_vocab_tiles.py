"""One vocabulary rank's logits tiled (issue 50, `mop.parallel.vocab.TiledHead`): the loss in blocks of
tokens, each block's logits formed again in the backward, equal to the full-logits head's loss and
gradients (fp32 summation order apart); no tensor of the full logits' size is kept; a run trains
like the reference; the fit tiles when the full logits do not fit."""

import pytest
import torch
from test_memory_fit import GIB, _need, _resolve
from test_train import run

from mop.models.config import ModelConfig
from mop.models.transformer import IGNORE_INDEX, build_model
from mop.parallel.vocab import tile_vocabulary

CFG = ModelConfig(vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2,
                  expert_intermediate=16, z_loss_coef=1e-3)


def batch(length=24):
    ids = torch.randint(0, CFG.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX
    return ids, labels


@pytest.mark.parametrize("block", [7, 48, 100])  # blocks ending mid-row, one per whole batch, one larger
def test_tiled_loss_and_gradients_equal_the_full_logits(block):
    full, tiled = build_model(CFG, 0), build_model(CFG, 0)
    tile_vocabulary(tiled, block)
    ids, labels = batch()
    losses = [model(ids, labels) for model in (full, tiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(full.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_tiled_per_token_log_probs_and_entropies_equal_the_full_logits():
    """What DPO (`token_logprobs`) and RL (with the entropies) read, and their gradients."""
    full, tiled = build_model(CFG, 0), build_model(CFG, 0)
    tile_vocabulary(tiled, 7)
    ids, labels = batch()
    terms = [model.policy_terms(ids, labels) for model in (full, tiled)]
    torch.testing.assert_close(terms[1].logps, terms[0].logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms[1].entropy, terms[0].entropy, rtol=1e-6, atol=1e-6)
    hidden = full.hidden_states(ids).hidden
    dpo = [model.lm_head.token_logprobs(hidden, labels) for model in (full, tiled)]
    torch.testing.assert_close(dpo[1], dpo[0], rtol=1e-6, atol=1e-6)
    for term in terms:
        term.logps.sum().backward()
    for (name, a), b in zip(full.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_no_tensor_of_the_full_logits_size_is_kept_for_the_backward():
    ids, labels = batch(96)  # the logits [192, 128] larger than any weight
    tokens = ids.numel()

    def largest_saved(model) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            model.loss_terms(ids, labels)
        return max(saved)

    tiled = build_model(CFG, 0)
    tile_vocabulary(tiled, 8)
    assert largest_saved(build_model(CFG, 0)) >= tokens * CFG.vocab_size
    assert largest_saved(tiled) < tokens * CFG.vocab_size  # the largest: the routed rows [T k, H]


def test_a_tiled_run_trains_like_the_reference(tmp_path):
    reference = run(tmp_path, "reference")
    records = run(tmp_path, "tiled", "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2",
                  "--parallel.expert=2", "--parallel.vocab=1", "--parallel.vocab_logits=recompute",
                  "--parallel.vocab_token_block=8")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


def test_the_fit_tiles_one_ranks_logits_when_they_do_not_fit():
    long = ["--model.vocab_size=151936", "--parallel.nproc=1", "--data.seq_len=16384"]
    plain = _resolve(*long, "--train.memory_budget=off")
    budget = 8 * GIB
    assert _need(plain) > budget  # the full [16384, 151936] fp32 logits alone are about 10 GB
    config = _resolve(*long, f"--train.memory_budget={budget}")
    assert config.parallel.vocab == 1 and config.parallel.vocab_logits == "recompute"
    assert "parallel.vocab_logits" in config.fit.searched and _need(config) <= budget
    assert "logits-recomputed" in config.fit.layout
