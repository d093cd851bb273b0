"""Training the multi-token-prediction depths (`mop.models.mtp`, `model.mtp_loss_coef` > 0).

Oracles: this file's own computation of DeepSeek-V3's MTP objective on each document alone, by
plain slicing (depth k reads the embedding k tokens ahead and the previous depth's hidden state,
predicts the label k tokens ahead; no lookahead, no position test), against the packed forward; the
single-process reference run against every layout; a Hugging Face round trip (from-hf ->
fine-tune with MTP -> to-hf) that writes the trained depths under the published names.
"""

import dataclasses
import json

import pytest
import torch
from test_lora import FAMILY_RUNS, assert_same_run
from test_mtp_layers import deepseek_config, hub_folder, written
from test_train import TINY, run

from mop.cli import main
from mop.models.config import ModelConfig
from mop.models.transformer import IGNORE_INDEX, build_model, mtp_targets

MTP = ["--model.mtp_layers=2", "--model.mtp_loss_coef=0.3"]


def small(depth=2):
    return ModelConfig(family="deepseek_v3", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=2, head_dim=12,
                       experts=4, top_k=2, expert_intermediate=16, shared_expert_intermediate=16, dense_layers=1,
                       mtp_layers=depth, mtp_loss_coef=0.3,
                       options={"qk_rope_head_dim": 4, "kv_lora_rank": 8, "v_head_dim": 8})


@torch.no_grad()
def by_hand(model, ids: torch.Tensor, depth: int) -> tuple[list[float], list[int]]:
    """Each depth's summed cross-entropy and target count over one document `ids [n]` alone (module docstring)."""
    n = ids.shape[0]
    labels = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)])
    h = model.hidden_states(ids[None]).hidden[0]
    sums, counts = [], []
    for k in range(1, depth + 1):
        module, block = model.mtp[k - 1], model.layers[model.cfg.layers + k - 1]
        length = n - k  # positions i whose token i + k exists
        x = module(h[:length][None], model.embed(ids[k:])[None])
        h, _ = block(x, torch.arange(length)[None], None)
        h = h[0]
        logits = model.lm_head(module.norm(h)).float()
        targets = labels[k:]  # t_{i+k+1}
        kept = targets != IGNORE_INDEX
        sums.append(float(torch.nn.functional.cross_entropy(logits[kept], targets[kept], reduction="sum")))
        counts.append(int(kept.sum()))
    return sums, counts


def test_the_packed_forward_computes_deepseeks_mtp_objective_document_by_document():
    cfg = small()
    model = build_model(cfg, seed=0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=generator)
    document_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 17 + [2] * 4])
    labels = ids.roll(-1, 1)
    ends = torch.cat([document_ids[:, 1:] != document_ids[:, :-1], torch.ones(2, 1, dtype=torch.bool)], 1)
    labels[ends] = IGNORE_INDEX  # no target across documents or past the row, as the packers do
    with torch.no_grad():
        terms = model.loss_terms(ids, labels, document_ids=document_ids)
    expected, counts = [0.0, 0.0], [0, 0]
    for row in range(2):
        for document in document_ids[row].unique():
            sums, n = by_hand(model, ids[row][document_ids[row] == document], 2)
            expected = [a + b for a, b in zip(expected, sums)]
            counts = [a + b for a, b in zip(counts, n)]
    torch.testing.assert_close(terms.mtp_ce, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    positions = torch.cat([torch.arange(10), torch.arange(14), torch.arange(3), torch.arange(17), torch.arange(4)])
    assert mtp_targets(labels, positions.view(2, 24), 2) == counts
    assert terms.expert_stats.shape == (cfg.moe_layers + 2, cfg.experts + 1)  # the depths' blocks' rows follow
    # the plain forward's mean loss adds the depths' term, each depth over its own targets
    with torch.no_grad():
        mean = model(ids, labels, document_ids=document_ids)
        main_terms = model.loss_terms(ids, labels, document_ids=document_ids, mtp=False)
    by_depth = sum(ce / n for ce, n in zip(expected, counts)) * cfg.mtp_loss_coef / 2
    plain = main_terms.ce_sum / main_terms.targets + model.aux_objective(terms.router, 2)
    torch.testing.assert_close(mean, plain + by_depth, rtol=1e-5, atol=1e-6)


def test_a_model_whose_layers_are_all_dense_trains_its_mtp_depths_moe_blocks():
    cfg = dataclasses.replace(small(1), dense_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    terms = build_model(cfg, seed=0).loss_terms(ids, ids.roll(-1, 1))
    assert terms.expert_stats.shape == (1, cfg.experts + 1) and terms.mtp_ce.shape == (1,)


def test_a_run_without_the_coefficient_builds_no_mtp_modules():
    cfg = ModelConfig(mtp_layers=1)
    assert not [name for name, _ in build_model(cfg, 0).named_parameters() if name.startswith("mtp.")]
    assert len(build_model(cfg, 0).layers) == cfg.layers


LAYOUT = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
          "--parallel.vocab=2", "--parallel.expert_balance=llep", "--train.activation_checkpointing=full",
          "--optim.offload=true"]


def test_mtp_training_is_the_reference_in_the_mop_layout(tmp_path):
    """Ulysses (the lookahead across slices), LLEP experts, the vocabulary ring, checkpointed blocks and
    the host optimizer, with two depths, against one process."""
    family = [*FAMILY_RUNS["deepseek_v3"], *MTP]
    reference = run(tmp_path, "reference", *family)
    records = run(tmp_path, "mop", *family, *LAYOUT)
    assert all(r["mtp_loss"] > 0 and r["mtp_ce"] > 0 for r in reference)
    assert_same_run(records, reference)
    assert [r["mtp_ce"] for r in records] == pytest.approx([r["mtp_ce"] for r in reference], rel=1e-5)
    assert reference[-1]["mtp_ce"] < reference[0]["mtp_ce"]  # the depths train


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [
    ("glm4_moe", ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
                  "--parallel.expert_balance=ep", "--parallel.vocab=1"]),
    ("deepseek_v3", ["--parallel.strategy=fsdp2", "--parallel.nproc=2"]),
], ids=["glm4_moe-ulysses-ep", "deepseek_v3-fsdp2"])
def test_mtp_training_is_the_reference_in_other_layouts(tmp_path, family, layout):
    from test_glm4_moe import GLM_RUN

    settings = [*(GLM_RUN if family == "glm4_moe" else FAMILY_RUNS[family]), *MTP]
    reference = run(tmp_path, "reference", *settings)
    records = run(tmp_path, "layout", *settings, *layout)
    assert_same_run(records, reference)
    assert [r["mtp_ce"] for r in records] == pytest.approx([r["mtp_ce"] for r in reference], rel=1e-5)


def test_from_hf_fine_tune_with_mtp_to_hf_writes_the_trained_depths(tmp_path):
    from test_hf_workflow import fine_tune, write_corpus

    mtp = hub_folder(tmp_path / "hf", deepseek_config())
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tokenizer=byte"]) == 0
    step = fine_tune(tmp_path / "imported", tmp_path / "run", write_corpus(tmp_path / "corpus.txt"), "--train.steps=2",
                     "--model.mtp_loss_coef=0.3")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("mtp_ce" in r for r in records)
    meta = json.loads((step / "mop.json").read_text())
    assert "mtp" not in meta  # trained: part of the model, not passed through
    assert main(["convert", "to-hf", str(step), str(tmp_path / "out"), "--dtype=float32"]) == 0
    out = written(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert out.keys() == written(tmp_path / "hf").keys()
    changed = [key for key in mtp if not torch.equal(out[key], mtp[key])]
    assert "model.layers.3.eh_proj.weight" in changed and "model.layers.3.mlp.gate.weight" in changed
    assert torch.equal(out["model.layers.3.embed_tokens.weight"], out["model.embed_tokens.weight"])
    assert torch.equal(out["model.layers.3.shared_head.head.weight"], out["lm_head.weight"])
    from mop import checkpoint

    shapes = {"mtp.0.eh_proj.weight": (64, 128), "layers.3.mlp.router.weight": (8, 64)}
    saved = checkpoint.read_tensors(step, meta, shapes, set())
    assert torch.equal(out["model.layers.3.eh_proj.weight"], saved["mtp.0.eh_proj.weight"])
    assert torch.equal(out["model.layers.3.mlp.gate.weight"], saved["layers.3.mlp.router.weight"])
    assert main(["convert", "from-hf", str(tmp_path / "out"), str(tmp_path / "again"), "--tokenizer=byte"]) == 0
    assert main(["convert", "to-hf", str(step), str(tmp_path / "dropped"), "--mtp=drop"]) == 0
    assert not [key for key in written(tmp_path / "dropped") if key.startswith("model.layers.3.")]
    assert json.loads((tmp_path / "dropped" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_a_checkpoint_saved_before_the_mtp_settings_existed_resumes(tmp_path):
    run(tmp_path, "old", "--train.steps=2")
    step = tmp_path / "old" / "checkpoints" / "step_2"
    meta = json.loads((step / "mop.json").read_text())
    for key in ("mtp_layers", "mtp_loss_coef"):
        del meta["config"]["model"][key]
    (step / "mop.json").write_text(json.dumps(meta))
    records = run(tmp_path, "old", "--train.steps=3", "--checkpoint.resume=latest")
    assert records[-1]["step"] == 3


@pytest.mark.parametrize("settings, key", [
    (["--model.mtp_loss_coef=0.3"], "model.mtp_loss_coef"),
    ([*MTP, "--train.finetune=lora"], "model.mtp_loss_coef"),
    ([*MTP, "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--data.seq_len=2",
      "--train.global_batch=2", "--train.micro_batch=1"], "parallel.sequence"),
])
def test_mtp_settings_that_cannot_train_are_refused_in_one_line(capsys, settings, key):
    assert main(["train", *TINY, *settings]) == 2
    message = capsys.readouterr().err.strip()
    assert key in message and len(message.splitlines()) == 1, message
