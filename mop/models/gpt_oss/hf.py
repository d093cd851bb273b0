"""gpt-oss checkpoints <-> mop (the shared keys and tensors: `mop.models.hf_mapping`).

Config: num_local_experts -> experts, intermediate_size -> expert_intermediate (the expert width;
gpt-oss has no dense blocks and no shared expert), router_aux_loss_coef -> aux_loss_coef (HF's
class default 0.001), head_dim; options: sliding_window, attention_bias, swiglu_limit,
swiglu_alpha, and YaRN from rope_parameters / rope_scaling (`yarn_options`; a config.json with
neither gets the reference's default YaRN, factor 32 over 4096 tokens, untruncated). layer_types
must be the reference's alternation (sliding on the even blocks); another pattern raises. The
published MXFP4 experts are dequantized as they are read (`mop.models.hf_quantized`).
Tensors beyond the shared norms, all whole tensors in both directions (the experts are stored in
HF's stacked layout, so the hub's and transformers' files are the same):
    attention.{q,k,v,o}_proj.{weight,bias} <- self_attn.<same> (biases with attention_bias),
    attention.sinks <- self_attn.sinks;
    mlp.router.{weight,bias} <- mlp.router.<same>;
    mlp.experts.gate_up_weight / gate_up_bias / down_weight / down_bias <-
        mlp.experts.gate_up_proj / gate_up_proj_bias / down_proj / down_proj_bias.
"""

from __future__ import annotations

from mop.models.gpt_oss.options import Options
from mop.models.hf_mapping import (HFMapping, HFConversionError, Piece, block_pieces as shared_block_pieces, required,
                                   shared_config_from_hf, yarn_options, yarn_to_hf)
from mop.models.shape import ModelShape

ARCHITECTURE = "GptOssForCausalLM"
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "router_aux_loss_coef": 0.001}
# GptOssConfig's RoPE when config.json names none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
EXPERT_TENSORS = {"gate_up_weight": "gate_up_proj", "gate_up_bias": "gate_up_proj_bias",
                  "down_weight": "down_proj", "down_bias": "down_proj_bias"}


def alternating_layers(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def config_from_hf(hf: dict) -> ModelShape:
    layers = required(hf, "num_hidden_layers")
    if hf.get("layer_types") not in (None, alternating_layers(layers)):
        raise HFConversionError("config.json: layer_types is not gpt-oss's alternation (sliding_attention on the even "
                                "layers, full_attention on the odd ones), the only one mop's gpt_oss builds")
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf = {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", DEFAULTS["rope_theta"])}}
    bias = bool(hf.get("attention_bias", True))
    shared = shared_config_from_hf(hf, DEFAULTS, attention_bias=bias, yarn=True)
    return ModelShape(
        **shared, experts=required(hf, "num_local_experts"), expert_intermediate=required(hf, "intermediate_size"),
        shared_expert_intermediate=0, dense_layers=0, qk_norm=False, norm_topk_prob=True,
        options=Options(sliding_window=required(hf, "sliding_window"), attention_bias=bias,
                        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), **yarn_options(hf)))


def config_to_hf(cfg: ModelShape) -> dict:
    o = cfg.options
    return dict(num_local_experts=cfg.experts, intermediate_size=cfg.expert_intermediate,
                sliding_window=o.sliding_window, layer_types=alternating_layers(cfg.layers),
                attention_bias=o.attention_bias, swiglu_limit=o.swiglu_limit, swiglu_alpha=o.swiglu_alpha,
                max_position_embeddings=int(o.yarn_original_context * o.yarn_factor),
                **yarn_to_hf(cfg, always=True))  # vLLM's gpt-oss reads rope_parameters["factor"] (gpt_oss.py:117)


def inexpressible(cfg: ModelShape) -> list[str]:
    problems = []
    if cfg.dense_layers:
        problems.append(f"model.dense_layers={cfg.dense_layers} (every gpt_oss block is an MoE block)")
    if cfg.shared_expert_intermediate:
        problems.append(f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (gpt_oss has no shared expert)")
    if cfg.qk_norm:
        problems.append("model.qk_norm=true (gpt_oss has no q/k norm)")
    return problems


def attention_tensors(cfg: ModelShape) -> list[str]:
    kinds = ("weight", "bias") if cfg.options.attention_bias else ("weight",)
    return [f"{name}.{kind}" for name in ("q_proj", "k_proj", "v_proj", "o_proj") for kind in kinds] + ["sinks"]


def experts(cfg: ModelShape, mop: str, hf: str) -> list[Piece]:
    """The biased router and the stacked experts (one layout on the hub and in transformers)."""
    pieces = [Piece(f"{mop}router.{kind}", (), f"{hf}mlp.router.{kind}") for kind in ("weight", "bias")]
    return pieces + [Piece(f"{mop}experts.{name}", (), f"{hf}mlp.experts.{key}") for name, key in EXPERT_TENSORS.items()]


def block_pieces(cfg: ModelShape, layer: int, stacked: bool) -> list[Piece]:
    # `stacked` (the loader saw mlp.experts.gate_up_proj) changes nothing: gpt-oss has one layout,
    # which the shared stacked branch (mlp.gate, SwiGLU names) does not describe.
    return shared_block_pieces(cfg, layer, False, attention_tensors(cfg), experts)


MAPPING = HFMapping(ARCHITECTURE, config_from_hf, config_to_hf, inexpressible, block_pieces)
