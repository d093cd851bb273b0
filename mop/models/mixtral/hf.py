"""Mixtral checkpoints <-> mop (the shared keys and tensors: `mop.models.hf_mapping`).

Config: num_local_experts -> experts, intermediate_size -> expert_intermediate, norm_topk_prob=True,
qk_norm=False, dense_layers=0 (dense_intermediate keeps its default, the one field a mixtral
config.json cannot carry; it is unused without dense layers). An active sliding_window (Mixtral
applies it whenever set) raises; router_jitter_noise touches training only and is ignored.
Hub expert layout, under block_sparse_moe.: router <- gate; expert e: w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from mop.models.hf_mapping import (HFMapping, HFConversionError, Piece, gqa_block_pieces, per_expert_pieces, required,
                                   shared_config_from_hf)
from mop.models.shape import ModelShape

ARCHITECTURE = "MixtralForCausalLM"
# The transformers class defaults for the keys a config.json may omit.
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "router_aux_loss_coef": 0.001}


def config_from_hf(hf: dict) -> ModelShape:
    shared = shared_config_from_hf(hf, DEFAULTS)
    if hf.get("sliding_window") is not None:
        raise HFConversionError(
            f"config.json: sliding_window={hf['sliding_window']} is active; mop has full causal attention only")
    return ModelShape(**shared, experts=required(hf, "num_local_experts"),
                       expert_intermediate=required(hf, "intermediate_size"), norm_topk_prob=True, qk_norm=False,
                       dense_layers=0)


def config_to_hf(cfg: ModelShape) -> dict:
    return dict(num_local_experts=cfg.experts, intermediate_size=cfg.expert_intermediate, sliding_window=None,
                router_jitter_noise=0.0)


def inexpressible(cfg: ModelShape) -> list[str]:
    problems = []
    if cfg.shared_expert_intermediate:
        problems.append(f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (a shared expert)")
    if cfg.qk_norm:
        problems.append("model.qk_norm=true (mixtral has no q/k norm; qwen3_moe has)")
    if not cfg.norm_topk_prob:
        problems.append("model.norm_topk_prob=false (mixtral always renormalises; qwen3_moe need not)")
    if cfg.dense_layers:
        problems.append(f"model.dense_layers={cfg.dense_layers} (mixtral has no dense layers; qwen3_moe has)")
    return problems


def block_pieces(cfg: ModelShape, layer: int, stacked: bool) -> list[Piece]:
    return gqa_block_pieces(cfg, layer, stacked, lambda cfg, mop, hf: per_expert_pieces(
        cfg, mop, hf + "block_sparse_moe.", ("w1", "w3", "w2")))


MAPPING = HFMapping(ARCHITECTURE, config_from_hf, config_to_hf, inexpressible, block_pieces)
