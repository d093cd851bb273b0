"""GLM-4.5 checkpoints <-> mop (the shared keys and tensors: `mop.models.hf_mapping`).

Config: n_routed_experts (alias num_local_experts) -> experts, moe_intermediate_size ->
expert_intermediate, n_shared_experts x moe_intermediate_size -> shared_expert_intermediate,
first_k_dense_replace -> dense_layers, intermediate_size -> dense_intermediate, use_qk_norm ->
qk_norm, norm_topk_prob; options: attention_bias, partial_rotary_factor (top level or in
rope_parameters), n_group -> groups, topk_group -> groups_per_token, routed_scaling_factor.
GLM trains without an auxiliary loss (its config has no router_aux_loss_coef): aux_loss_coef 0.
Tensors beyond the shared ones: self_attn.{q,k,v}_proj.bias with attention_bias;
mlp.router.score_correction_bias <- mlp.gate.e_score_correction_bias (fp32 buffer);
mlp.shared.{gate,up,down}_proj <- mlp.shared_experts.<same>; hub experts
mlp.experts.{e}.{gate,up,down}_proj. The multi-token-prediction layers of the hub checkpoints
(`model.layers.{num_hidden_layers}.*`, which transformers ignores; num_nextn_predict_layers ->
mtp_layers) are trained with `model.mtp_loss_coef` > 0 (`mop.models.hf_mapping.mtp_pieces`);
otherwise they stay frozen outside the model and `to-hf` and `merge` pass them through
(`mop.models.hf.MtpLayers`).
"""

from __future__ import annotations

from mop.models.glm4_moe.options import Options
from mop.models.hf_mapping import (HFMapping, Piece, gqa_block_pieces, hub_swiglu_experts, required,
                                   shared_config_from_hf, sigmoid_router_pieces)
from mop.models.shape import ModelShape

ARCHITECTURE = "Glm4MoeForCausalLM"
# The transformers class defaults for the keys a config.json may omit.
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "router_aux_loss_coef": 0.0}


def config_from_hf(hf: dict) -> ModelShape:
    bias = bool(hf.get("attention_bias", False))
    shared = shared_config_from_hf(hf, DEFAULTS, attention_bias=bias)
    expert_intermediate = required(hf, "moe_intermediate_size")
    rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return ModelShape(
        **shared, experts=hf.get("n_routed_experts", hf.get("num_local_experts")) or required(hf, "n_routed_experts"),
        expert_intermediate=expert_intermediate,
        shared_expert_intermediate=hf.get("n_shared_experts", 1) * expert_intermediate,
        dense_layers=hf.get("first_k_dense_replace", 1), dense_intermediate=required(hf, "intermediate_size"),
        qk_norm=bool(hf.get("use_qk_norm", False)), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        options=Options(attention_bias=bias, partial_rotary_factor=float(rotary), groups=hf.get("n_group", 1),
                        groups_per_token=hf.get("topk_group", 1),
                        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0))))


def config_to_hf(cfg: ModelShape) -> dict:
    options = cfg.options
    return dict(n_routed_experts=cfg.experts, moe_intermediate_size=cfg.expert_intermediate,
                n_shared_experts=cfg.shared_expert_intermediate // cfg.expert_intermediate,
                first_k_dense_replace=cfg.dense_layers, intermediate_size=cfg.dense_intermediate,
                use_qk_norm=cfg.qk_norm, norm_topk_prob=cfg.norm_topk_prob, attention_bias=options.attention_bias,
                partial_rotary_factor=options.partial_rotary_factor, n_group=options.groups,
                topk_group=options.groups_per_token, routed_scaling_factor=options.routed_scaling_factor,
                num_nextn_predict_layers=cfg.trained_mtp_layers)


def inexpressible(cfg: ModelShape) -> list[str]:
    if cfg.shared_expert_intermediate % cfg.expert_intermediate:
        return [f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (glm4_moe's shared experts are "
                f"whole multiples of model.expert_intermediate={cfg.expert_intermediate})"]
    return []


def block_pieces(cfg: ModelShape, layer: int, stacked: bool) -> list[Piece]:
    pieces = gqa_block_pieces(cfg, layer, stacked, hub_swiglu_experts)
    if cfg.options.attention_bias:
        pieces += [Piece(f"layers.{layer}.attention.{name}.bias", (), f"model.layers.{layer}.self_attn.{name}.bias")
                   for name in ("q_proj", "k_proj", "v_proj")]
    return pieces + sigmoid_router_pieces(cfg, layer)


MAPPING = HFMapping(ARCHITECTURE, config_from_hf, config_to_hf, inexpressible, block_pieces,
                    mtp_layers=True)  # the checkpoint's layers after the last block (num_nextn_predict_layers)
