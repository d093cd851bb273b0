"""DeepSeek-V3 / Kimi-K2 checkpoints <-> mop (the shared keys and tensors: `mop.models.hf_mapping`).

Config: kv_heads = num_attention_heads (latent attention), head_dim = qk_nope_head_dim +
qk_rope_head_dim; n_routed_experts -> experts, moe_intermediate_size -> expert_intermediate,
n_shared_experts x moe_intermediate_size -> shared_expert_intermediate, first_k_dense_replace ->
dense_layers, intermediate_size -> dense_intermediate, norm_topk_prob; options: q_lora_rank (null
-> 0), kv_lora_rank, qk_rope_head_dim, v_head_dim, rope_interleave, attention_bias, n_group ->
groups, topk_group -> groups_per_token, routed_scaling_factor, and YaRN from rope_parameters /
rope_scaling (`yarn_options`). `model_type` "kimi_k2" (Kimi-K2's own folder, same architecture)
reads as deepseek_v3. No auxiliary loss in the HF model: aux_loss_coef 0.
Tensors beyond the shared norms: self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj} (biases on q_a, kv_a and o with
attention_bias), the sigmoid router's bias and the shared experts (`sigmoid_router_pieces`), hub
experts mlp.experts.{e}.{gate,up,down}_proj. Multi-token-prediction layers
(`model.layers.{num_hidden_layers}.*`, num_nextn_predict_layers -> mtp_layers) are trained with
`model.mtp_loss_coef` > 0 (`mop.models.hf_mapping.mtp_pieces`); otherwise they stay frozen outside
the model and `to-hf` and `merge` pass them through (`mop.models.hf.MtpLayers`).
"""

from __future__ import annotations

from mop.models.deepseek_v3.options import Options
from mop.models.hf_mapping import (HFConversionError, HFMapping, Piece, block_pieces as mlp_block_pieces,
                                   hub_swiglu_experts, required, shared_config_from_hf, sigmoid_router_pieces,
                                   yarn_options, yarn_to_hf)
from mop.models.shape import ModelShape

ARCHITECTURE = "DeepseekV3ForCausalLM"
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "router_aux_loss_coef": 0.0}
ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""The router mop's deepseek_v3 is (group-limited sigmoid scores with a selection bias), as DeepSeek-V3 and
Kimi-K2 publish it: transformers' config has neither key, but vLLM builds its router from them
(`deepseek_v2.py`: without `noaux_tc` a softmax router with no `e_score_correction_bias`)."""


def config_from_hf(hf: dict) -> ModelShape:
    for key, value in ROUTER.items():
        if hf.get(key, value) != value:
            raise HFConversionError(f"config.json: {key}={hf[key]!r}; mop's deepseek_v3 router is {key}={value!r} "
                                    "(DeepSeek-V3's and Kimi-K2's)")
    bias = bool(hf.get("attention_bias", False))
    shared = shared_config_from_hf({**hf, "model_type": "deepseek_v3"}, DEFAULTS, attention_bias=bias, yarn=True)
    rope, nope = required(hf, "qk_rope_head_dim"), required(hf, "qk_nope_head_dim")
    expert_intermediate = required(hf, "moe_intermediate_size")
    shared.update(kv_heads=shared["heads"], head_dim=nope + rope)
    return ModelShape(
        **shared, experts=hf.get("n_routed_experts", hf.get("num_local_experts")) or required(hf, "n_routed_experts"),
        expert_intermediate=expert_intermediate,
        shared_expert_intermediate=(hf.get("n_shared_experts") or 0) * expert_intermediate,
        dense_layers=hf.get("first_k_dense_replace", 0), dense_intermediate=required(hf, "intermediate_size"),
        qk_norm=False, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        options=Options(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=required(hf, "kv_lora_rank"),
                        qk_rope_head_dim=rope, v_head_dim=required(hf, "v_head_dim"),
                        rope_interleave=bool(hf.get("rope_interleave", True)), attention_bias=bias,
                        groups=hf.get("n_group") or 1, groups_per_token=hf.get("topk_group") or 1,
                        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), **yarn_options(hf)))


def config_to_hf(cfg: ModelShape) -> dict:
    o = cfg.options
    return dict(n_routed_experts=cfg.experts, moe_intermediate_size=cfg.expert_intermediate,
                n_shared_experts=cfg.shared_expert_intermediate // cfg.expert_intermediate,
                first_k_dense_replace=cfg.dense_layers, intermediate_size=cfg.dense_intermediate,
                norm_topk_prob=cfg.norm_topk_prob, q_lora_rank=o.q_lora_rank or None, kv_lora_rank=o.kv_lora_rank,
                qk_rope_head_dim=o.qk_rope_head_dim, qk_nope_head_dim=cfg.head_dim - o.qk_rope_head_dim,
                v_head_dim=o.v_head_dim, head_dim=o.qk_rope_head_dim, rope_interleave=o.rope_interleave,
                attention_bias=o.attention_bias, n_group=o.groups, topk_group=o.groups_per_token,
                routed_scaling_factor=o.routed_scaling_factor, num_nextn_predict_layers=cfg.trained_mtp_layers,
                **ROUTER,
                max_position_embeddings=int(o.yarn_original_context * o.yarn_factor),
                **yarn_to_hf(cfg))


def inexpressible(cfg: ModelShape) -> list[str]:
    problems = []
    if cfg.shared_expert_intermediate % cfg.expert_intermediate:
        problems.append(f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (deepseek_v3's shared "
                        f"experts are whole multiples of model.expert_intermediate={cfg.expert_intermediate})")
    if cfg.qk_norm:
        problems.append("model.qk_norm=true (latent attention has no q/k norm)")
    return problems


def attention_tensors(cfg: ModelShape) -> list[str]:
    o = cfg.options
    names = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"] if o.q_lora_rank else ["q_proj.weight"]
    names += ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    if o.attention_bias:
        names += [name + ".bias" for name in (["q_a_proj"] if o.q_lora_rank else []) + ["kv_a_proj_with_mqa", "o_proj"]]
    return names


def block_pieces(cfg: ModelShape, layer: int, stacked: bool) -> list[Piece]:
    return mlp_block_pieces(cfg, layer, stacked, attention_tensors(cfg), hub_swiglu_experts) + sigmoid_router_pieces(
        cfg, layer)


MAPPING = HFMapping(ARCHITECTURE, config_from_hf, config_to_hf, inexpressible, block_pieces, model_types=("kimi_k2",),
                    mtp_layers=True)
