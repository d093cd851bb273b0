"""Model shape facts (`mop.models.spec`, one per family): parameter counts against the built model,
what a token is multiplied with, and the causal attention convention of the FLOPs (`mop.flops`)."""

import dataclasses

import pytest
import torch

from mop.cli import main
from mop.flops import attended_keys
from mop.models.config import ModelConfig
from mop.models.families import FAMILIES, model_spec
from mop.models.transformer import MoETransformer, build_model, document_positions

CFG = ModelConfig(vocab_size=97, hidden=16, layers=3, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=4,
                  expert_intermediate=8, shared_expert_intermediate=8, dense_layers=1, dense_intermediate=24)
SHAPES = [CFG, dataclasses.replace(CFG, tie_embeddings=True, qk_norm=False, shared_expert_intermediate=0),
          dataclasses.replace(CFG, dense_layers=0, head_dim=6, heads=2, kv_heads=1),
          dataclasses.replace(CFG, mtp_layers=2, mtp_loss_coef=0.1)]  # two trained MTP depths (mop.models.mtp)


def category(name: str) -> str:
    """The spec's categories, read from parameter names written independently of `mop.models.spec`."""
    if ".experts." in name:
        return "expert"
    return "vocabulary" if name in ("embed.weight", "lm_head.weight") else "dense"


def counts_by_category(cfg: ModelConfig) -> dict[str, int]:
    """Parameter elements of the meta-built model by `category` (tied: one parameter, listed once)."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    counts = dict.fromkeys(("dense", "expert", "vocabulary"), 0)
    for name, param in model.named_parameters():
        counts[category(name)] += param.numel()
    return counts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_the_spec_counts_the_parameters_the_built_model_has_by_category(family, shape):
    cfg = dataclasses.replace(SHAPES[shape], family=family)
    assert model_spec(cfg).parameters() == counts_by_category(cfg)


# Family options that add parameters: biases, a q LoRA, sinks.
WITH_OPTIONS = [dataclasses.replace(CFG, family="deepseek_v3", kv_heads=4, head_dim=12,
                                    options={"q_lora_rank": 8, "attention_bias": True, "qk_rope_head_dim": 4,
                                             "kv_lora_rank": 10, "v_head_dim": 6}),
                dataclasses.replace(CFG, family="glm4_moe", options={"attention_bias": True}),
                dataclasses.replace(CFG, family="gpt_oss", qk_norm=False, options={"sliding_window": 4})]


@pytest.mark.parametrize("cfg", WITH_OPTIONS, ids=lambda cfg: cfg.family)
def test_the_spec_counts_the_parameters_a_familys_options_add(cfg):
    assert not cfg.validate() and model_spec(cfg).parameters() == counts_by_category(cfg)


@pytest.mark.parametrize("cfg", [CFG, *WITH_OPTIONS], ids=lambda cfg: cfg.family)
def test_with_every_expert_active_a_token_meets_every_matrix_but_the_embedding(cfg):
    """top_k = experts: each token is multiplied with every weight matrix once (the embedding is a lookup)."""
    model = build_model(cfg, seed=0)
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() >= 2 and name != "embed.weight" and not name.endswith("bias"))  # gpt_oss's [E, 2I] biases
    assert model_spec(cfg).matmul_parameters_per_token() == matrices
    spec = model_spec(CFG)
    # Fewer active experts: only top_k of them count.
    half = model_spec(dataclasses.replace(CFG, top_k=2))
    assert spec.matmul_parameters_per_token() - half.matmul_parameters_per_token() == (CFG.layers - 1) * 2 * 3 * 16 * 8
    assert spec.routed_expert_flops() - half.routed_expert_flops() == 2 * (CFG.layers - 1) * 2 * 3 * 16 * 8


def test_causal_attention_counts_the_keys_each_query_attends():
    ids = torch.tensor([[0, 0, 0, 1, 1]])
    assert attended_keys(document_positions(ids)).tolist() == [[1, 2, 3, 1, 2]]
    spec = model_spec(CFG)
    no_attention = spec.flops_per_token(0.0)
    # q.k and p.v: 2 matmuls of head_dim per query head and key, 2 FLOPs each, x 3 for the backward
    assert spec.flops_per_token(CFG.layers * 10.0) - no_attention == CFG.layers * CFG.heads * CFG.head_dim * 10.0 * 12
    assert no_attention == 6 * spec.matmul_parameters_per_token()


def test_a_sliding_window_layer_counts_the_keys_its_window_holds():
    """gpt-oss's even layers see at most W keys: of a 10-token document's positions 0-9 a window of 4
    attends 1, 2, 3, 4, 4, ...; the full layers attend position + 1."""
    from mop.flops import mean_attended_keys

    cfg = dataclasses.replace(CFG, family="gpt_oss", qk_norm=False, options={"sliding_window": 4})
    spec = model_spec(cfg)
    assert spec.layer_windows() == [4, None, 4]
    positions = torch.arange(10)
    assert attended_keys(positions, 4).tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    assert mean_attended_keys(10, 4) == pytest.approx(attended_keys(positions, 4).float().mean().item()) == 3.4
    assert spec.layer_keys(lambda window: mean_attended_keys(10, window)) == pytest.approx(2 * 3.4 + 5.5)


def test_the_attention_widths_are_the_modules():
    spec = model_spec(CFG).attention
    attention = build_model(CFG, seed=0).layers[0].attention
    assert (spec.q_width, spec.k_width, spec.v_width) == tuple(
        p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert spec.out_width == attention.o_proj.weight.shape[1]


def test_mop_bench_gpu_without_a_gpu_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    assert main(["bench", "gpu", "--skip-tests"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: mop bench gpu: needs a CUDA GPU") and "\n" not in err


def test_a_token_meets_every_matrix_of_the_mtp_depths_and_the_head_once_per_depth():
    cfg = dataclasses.replace(CFG, mtp_layers=2, mtp_loss_coef=0.1)
    model = build_model(cfg, seed=0)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and name != "embed.weight")
    head = cfg.vocab_size * cfg.hidden
    assert model_spec(cfg).matmul_parameters_per_token() == matrices + 2 * head
