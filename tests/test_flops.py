"""Model FLOPs (`mop.flops`): what a token is multiplied with, and the causal attention convention."""

import dataclasses

import pytest
import torch

from mop.cli import main
from mop.flops import attended_keys, flops_per_token, matmul_params_per_token
from mop.models.config import ModelConfig
from mop.models.transformer import build_model, document_positions

CFG = ModelConfig(vocab_size=97, hidden=16, layers=3, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=4,
                  expert_intermediate=8, shared_expert_intermediate=8, dense_layers=1, dense_intermediate=24)


def test_with_every_expert_active_a_token_meets_every_matrix_but_the_embedding():
    """top_k = experts: each token is multiplied with every weight matrix once (the embedding is a lookup)."""
    model = build_model(CFG, seed=0)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and name != "embed.weight")
    assert matmul_params_per_token(CFG) == matrices
    # Fewer active experts: only top_k of them count.
    half = dataclasses.replace(CFG, top_k=2)
    assert matmul_params_per_token(CFG) - matmul_params_per_token(half) == (CFG.layers - 1) * 2 * 3 * 16 * 8


def test_causal_attention_counts_the_keys_each_query_attends():
    ids = torch.tensor([[0, 0, 0, 1, 1]])
    assert attended_keys(document_positions(ids)).tolist() == [[1, 2, 3, 1, 2]]
    no_attention = flops_per_token(CFG, 0.0)
    assert flops_per_token(CFG, 10.0) - no_attention == CFG.layers * CFG.heads * CFG.head_dim * 10.0 * 12
    assert no_attention == 6 * matmul_params_per_token(CFG)


def test_mop_bench_gpu_without_a_gpu_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    assert main(["bench", "gpu", "--skip-tests"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mop: error: mop bench gpu: needs a CUDA GPU") and "\n" not in err
