"""Qwen3-MoE checkpoints <-> mop (the shared keys and tensors: `mop.models.hf_mapping`).

Config: num_experts (transformers 5.x writes num_local_experts) -> experts,
moe_intermediate_size -> expert_intermediate, intermediate_size -> dense_intermediate,
norm_topk_prob, qk_norm=True, mlp_only_layers / decoder_sparse_step -> dense_layers (only a dense
prefix 0..k-1). sliding_window counts only with use_sliding_window, which mop refuses.
Hub expert layout: mlp.router <- mlp.gate; expert e: w_gate_up[e, :I] <- mlp.experts.{e}.gate_proj,
w_gate_up[e, I:] <- up_proj, w_down[e] <- down_proj.
"""

from __future__ import annotations

from mop.models.hf_mapping import (HFMapping, HFConversionError, Piece, gqa_block_pieces, hub_swiglu_experts, required,
                                   shared_config_from_hf)
from mop.models.shape import ModelShape

ARCHITECTURE = "Qwen3MoeForCausalLM"
# The transformers class defaults for the keys a config.json may omit.
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "router_aux_loss_coef": 0.001}


def config_from_hf(hf: dict) -> ModelShape:
    shared = shared_config_from_hf(hf, DEFAULTS)
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window"):
        raise HFConversionError(
            f"config.json: sliding_window={hf['sliding_window']} is active; mop has full causal attention only")
    # The hub and transformers 4.x write num_experts; 5.x writes its alias num_local_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise HFConversionError("config.json lacks num_experts (or num_local_experts); add the expert count")
    return ModelShape(**shared, experts=experts, expert_intermediate=required(hf, "moe_intermediate_size"),
                       dense_intermediate=required(hf, "intermediate_size"),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])), qk_norm=True,
                       dense_layers=_dense_layers(hf, shared["layers"]))


def _dense_layers(hf: dict, layers: int) -> int:
    """Qwen3-MoE makes layer i dense if i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0;
    mop's dense layers are a prefix, so only a set {0, ..., k-1} converts (to dense_layers=k)."""
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = hf.get("mlp_only_layers") or []
    if step < 1:
        raise HFConversionError(f"config.json: decoder_sparse_step={step} must be >= 1")
    dense = [i for i in range(layers) if i in mlp_only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise HFConversionError(
            f"config.json: mlp_only_layers={mlp_only} with decoder_sparse_step={step} makes layers {dense} dense; "
            "mop supports dense layers only as the first k layers")
    return len(dense)


def config_to_hf(cfg: ModelShape) -> dict:
    return dict(num_experts=cfg.experts, moe_intermediate_size=cfg.expert_intermediate,
                intermediate_size=cfg.dense_intermediate, norm_topk_prob=cfg.norm_topk_prob,
                mlp_only_layers=list(range(cfg.dense_layers)), decoder_sparse_step=1,
                attention_bias=False, use_sliding_window=False, sliding_window=None)


def inexpressible(cfg: ModelShape) -> list[str]:
    problems = []
    if cfg.shared_expert_intermediate:
        problems.append(f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (a shared expert)")
    if not cfg.qk_norm:
        problems.append("model.qk_norm=false (qwen3_moe always normalises q and k; mixtral does not)")
    return problems


def block_pieces(cfg: ModelShape, layer: int, stacked: bool) -> list[Piece]:
    return gqa_block_pieces(cfg, layer, stacked, hub_swiglu_experts)


MAPPING = HFMapping(ARCHITECTURE, config_from_hf, config_to_hf, inexpressible, block_pieces)
