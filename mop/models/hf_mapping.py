"""What a family's Hugging Face mapping is made of: the config keys and checkpoint tensors the
families share, and the `HFMapping` each family folder builds in its `hf.py`.

A mapping turns a parsed `config.json` into a `ModelShape` and back, says which configs it cannot
express, and lists the checkpoint tensors (`Piece`s) that hold each mop parameter. The loading and
saving machinery (`mop.models.hf`) is family-independent: it reads and writes pieces.

Shared by every family here (`config.json` key -> `ModelShape` field):
    hidden_size -> hidden, num_hidden_layers -> layers, num_attention_heads -> heads,
    num_key_value_heads -> kv_heads, head_dim -> head_dim (default hidden / heads), vocab_size,
    rms_norm_eps -> norm_eps, rope_parameters.rope_theta or rope_theta -> rope_theta,
    num_experts_per_tok -> top_k, tie_word_embeddings -> tie_embeddings,
    initializer_range -> init_std, router_aux_loss_coef -> aux_loss_coef.
Features that would change the function computed (attention_bias, non-default RoPE, an activation
other than silu) raise. Settings that touch training only are ignored, as they do not change the
model and mop's objective has none of them (attention_dropout, pad_token_id: HF's embedding
freezes that row's gradient). router_aux_loss_coef is mapped as is, although HF adds the aux loss
only when called with `output_router_logits=True`: mop's loss is HF's loss with that flag (for one
sequence; HF pools the load-balancing statistics over a batch, mop per sequence).

Shared tensors (mop parameter <- checkpoint tensor), per layer i under `model.layers.{i}.`:
    embed.weight <- model.embed_tokens.weight; norm.weight <- model.norm.weight;
    lm_head.weight <- lm_head.weight (absent on disk when tied);
    attn_norm / mlp_norm <- input_layernorm / post_attention_layernorm;
    attention.{q,k,v,o}_proj, attention.{q,k}_norm <- self_attn.<same>;
    dense block mlp.{gate,up,down}_proj <- mlp.<same>;
    MoE block, stacked layout (transformers 5.x in-memory names): mlp.router <- mlp.gate,
        w_gate_up <- mlp.experts.gate_up_proj, w_down <- mlp.experts.down_proj;
    MoE block, hub layout (per expert, what the hub serves and `save_pretrained` writes): the
        family's own names (`hub_expert_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mop.models.shape import ModelShape


class HFConversionError(ValueError):
    """A Hugging Face config or checkpoint that mop cannot convert as it stands."""


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and the part of a mop parameter it holds."""

    param: str
    index: tuple
    """Index into the mop parameter; () for the whole parameter."""
    key: str


@dataclass(frozen=True)
class HFMapping:
    """A family's mapping to and from its HF checkpoints, built once in its folder's `hf.py`
    (`MAPPING`): every attribute `mop.models.hf` reads of a family's mapping."""

    architecture: str
    """The HF class name, `architectures[0]` in config.json."""
    config_from_hf: Callable[[dict], ModelShape]
    """The model a parsed config.json of this family describes, its options built; raises
    `HFConversionError`."""
    config_to_hf: Callable[[ModelShape], dict]
    """The family's own config.json keys for a model (the shared ones: `shared_config_to_hf`)."""
    inexpressible: Callable[[ModelShape], list[str]]
    """The settings of a model the family's HF model has no equivalent of (empty: it saves exactly)."""
    block_pieces: Callable[[ModelShape, int, bool], list[Piece]]
    """`(cfg, layer, stacked)`: the tensors of block `layer`, its experts in the stacked layout when
    `stacked`."""
    model_types: tuple[str, ...] = ()
    """The `model_type`s its checkpoints carry besides the family's name (Kimi-K2's `kimi_k2`)."""
    mtp_layers: bool = False
    """Its checkpoints hold multi-token-prediction layers after the last block (`mtp_pieces`): trained
    with `model.mtp_loss_coef` > 0, else kept aside by `mop.models.hf` (`HFWeights.mtp`) and passed
    through (`MtpLayers`)."""


# ---------------------------------------------------------------- config


def required(hf: dict, key: str):
    if hf.get(key) is None:
        raise HFConversionError(f"config.json lacks {key}, which fixes the {hf['model_type']} model's shapes; add it")
    return hf[key]


def shared_config_from_hf(hf: dict, defaults: dict, attention_bias: bool = False, yarn: bool = False) -> dict:
    """The `ModelShape` fields every family reads alike; `defaults`: the family's class defaults
    for `rms_norm_eps`, `rope_theta` and `router_aux_loss_coef`; `attention_bias`: the family's
    attention takes biases (its own option); `yarn`: the family implements YaRN (`yarn_options`)."""
    check_shared_features(hf, attention_bias, yarn)
    heads = required(hf, "num_attention_heads")
    # transformers 5.x reads rope_parameters first and falls back to the 4.x top-level rope_theta.
    rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", defaults["rope_theta"]))
    return dict(
        family=hf["model_type"],
        vocab_size=required(hf, "vocab_size"),
        hidden=required(hf, "hidden_size"),
        layers=required(hf, "num_hidden_layers"),
        heads=heads,
        # Required: the families default it differently (Qwen3-MoE to 4, Mixtral to 8).
        kv_heads=required(hf, "num_key_value_heads"),
        head_dim=hf.get("head_dim") or required(hf, "hidden_size") // heads,
        rope_theta=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        top_k=required(hf, "num_experts_per_tok"),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def rope_parameters(hf: dict) -> dict:
    """The RoPE settings of a config.json: transformers 5.x `rope_parameters`, or 4.x `rope_scaling`."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def rope_type(hf: dict) -> str:
    rope = rope_parameters(hf)
    return rope.get("rope_type", rope.get("type", "default"))


def yarn_options(hf: dict) -> dict:
    """`mop.models.rope.YarnOptions` fields of a config.json (empty for the default RoPE)."""
    if rope_type(hf) != "yarn":
        return {}
    rope = rope_parameters(hf)
    if rope.get("attention_factor") is not None:
        raise HFConversionError("config.json: rope attention_factor is set explicitly; mop derives it from factor, "
                                "mscale and mscale_all_dim only")
    factor = rope.get("factor") or hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return {"yarn_factor": float(factor), "yarn_original_context": int(rope["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            "yarn_mscale": float(rope.get("mscale") or 0), "yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0),
            "yarn_truncate": bool(rope.get("truncate", True))}


def yarn_to_hf(cfg: ModelShape, always: bool = False) -> dict:
    """The RoPE keys of config.json for a family with `YarnOptions` (the default RoPE when off, unless
    `always`: YaRN's keys at factor 1, which is the default RoPE exactly, for a family whose engines read
    them unconditionally)."""
    o = cfg.options
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = o.yarn or always
    if yarn:
        rope.update(rope_type="yarn", factor=o.yarn_factor, original_max_position_embeddings=o.yarn_original_context,
                    beta_fast=o.yarn_beta_fast, beta_slow=o.yarn_beta_slow,
                    **({} if o.yarn_truncate else {"truncate": False}),  # unset means true
                    **({"mscale": o.yarn_mscale} if o.yarn_mscale else {}),
                    **({"mscale_all_dim": o.yarn_mscale_all_dim} if o.yarn_mscale_all_dim else {}))
    # transformers 5.x reads rope_parameters, 4.x rope_scaling (YaRN only) beside the top-level rope_theta
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if yarn else None
    return {"rope_parameters": rope, **({"rope_scaling": scaling} if scaling else {})}


def check_shared_features(hf: dict, attention_bias: bool = False, yarn: bool = False) -> None:
    """Raise on config settings that change the function the HF model computes and mop cannot."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"config.json: hidden_act={hf['hidden_act']!r}; mop's experts use silu only")
    if hf.get("attention_bias") and not attention_bias:
        raise HFConversionError(f"config.json: attention_bias=true; mop's {hf['model_type']} attention has no bias")
    kind = rope_type(hf)
    if kind not in (("default", "yarn") if yarn else ("default",)):
        supported = "the default RoPE and YaRN" if yarn else "the default RoPE only"
        raise HFConversionError(f"config.json: rope_type={kind!r}; mop's {hf['model_type']} implements {supported}")


def shared_config_to_hf(cfg: ModelShape, architecture: str, dtype: torch.dtype) -> dict:
    """The config.json keys every family writes alike. Both `rope_theta` (read by transformers 4.x)
    and `rope_parameters` (5.x), and both `torch_dtype` and `dtype`, are written so that every
    transformers version reads the same model."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


# ---------------------------------------------------------------- tensors


def model_pieces(cfg: ModelShape, mapping: HFMapping, stacked_layers: set[int]) -> list[Piece]:
    """The checkpoint tensors of a model, MoE layers in `stacked_layers` in the stacked layout (its
    trained multi-token-prediction depths included, `mtp_pieces`)."""
    pieces = [Piece("embed.weight", (), "model.embed_tokens.weight"), Piece("norm.weight", (), "model.norm.weight")]
    if not cfg.tie_embeddings:
        pieces.append(Piece("lm_head.weight", (), "lm_head.weight"))
    for layer in range(cfg.layers):
        pieces += mapping.block_pieces(cfg, layer, layer in stacked_layers)
    return pieces + mtp_pieces(cfg, mapping, stacked_layers)


def mtp_pieces(cfg: ModelShape, mapping: HFMapping, stacked_layers: set[int]) -> list[Piece]:
    """A model's trained MTP depths (`mop.models.mtp`) as DeepSeek-V3 and GLM-4.5 publish them: depth
    k's layer `model.layers.{layers + k - 1}` holds its block's tensors (`layers.{layers + k - 1}` in
    mop), `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (`mtp.{k - 1}.*`), and copies of the
    embedding and the output projection (`embed_tokens`, `shared_head.head`): written from mop's one
    embedding and head, read once (`mop.models.hf.HFWeights`)."""
    pieces = []
    for k in range(cfg.trained_mtp_layers):
        layer, mop = cfg.layers + k, f"mtp.{k}."
        hf = f"model.layers.{layer}."
        pieces += mapping.block_pieces(cfg, layer, layer in stacked_layers)
        pieces += [Piece(f"{mop}{name}.weight", (), f"{hf}{name}.weight") for name in ("enorm", "hnorm", "eh_proj")]
        head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
        pieces += [Piece(f"{mop}norm.weight", (), f"{hf}shared_head.norm.weight"),
                   Piece("embed.weight", (), f"{hf}embed_tokens.weight"),
                   Piece(head, (), f"{hf}shared_head.head.weight")]
    return pieces


def stacked_experts_key(layer: int) -> str:
    """The tensor whose presence marks a layer saved in the stacked expert layout."""
    return f"model.layers.{layer}.mlp.experts.gate_up_proj"


def gqa_block_pieces(cfg: ModelShape, layer: int, stacked: bool, hub_experts) -> list[Piece]:
    """A block of grouped-query attention and a SwiGLU MoE (or a dense MLP), its experts in the
    stacked layout or in the family's hub layout, `hub_experts(cfg, mop_prefix, hf_prefix)`."""
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
    return block_pieces(cfg, layer, stacked, [f"{name}.weight" for name in attention], hub_experts)


def block_pieces(cfg: ModelShape, layer: int, stacked: bool, attention: list[str], hub_experts) -> list[Piece]:
    """A block whose attention holds the tensors `attention` (names under `self_attn.`, the same in
    mop under `attention.`) and a SwiGLU MoE or dense MLP, as `gqa_block_pieces`."""
    mop, hf = f"layers.{layer}.", f"model.layers.{layer}."
    pieces = [Piece(mop + "attn_norm.weight", (), hf + "input_layernorm.weight"),
              Piece(mop + "mlp_norm.weight", (), hf + "post_attention_layernorm.weight")]
    pieces += [Piece(f"{mop}attention.{name}", (), f"{hf}self_attn.{name}") for name in attention]
    if layer < cfg.dense_layers:
        return pieces + [Piece(f"{mop}mlp.{name}.weight", (), f"{hf}mlp.{name}.weight")
                         for name in ("gate_proj", "up_proj", "down_proj")]
    if stacked:
        return pieces + [Piece(mop + "mlp.router.weight", (), hf + "mlp.gate.weight"),
                         Piece(mop + "mlp.experts.w_gate_up", (), hf + "mlp.experts.gate_up_proj"),
                         Piece(mop + "mlp.experts.w_down", (), hf + "mlp.experts.down_proj")]
    return pieces + hub_experts(cfg, mop + "mlp.", hf)


def sigmoid_router_pieces(cfg: ModelShape, layer: int) -> list[Piece]:
    """DeepSeek-V3-style MoE extras (glm4_moe, deepseek_v3): the router's score-correction bias
    (an fp32 buffer) and the shared experts, whose `n_shared_experts` are one wider SwiGLU."""
    if layer < cfg.dense_layers:
        return []
    mop, hf = f"layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    pieces = [Piece(mop + "router.score_correction_bias", (), hf + "gate.e_score_correction_bias")]
    if cfg.shared_expert_intermediate:
        pieces += [Piece(f"{mop}shared.{name}.weight", (), f"{hf}shared_experts.{name}.weight")
                   for name in ("gate_proj", "up_proj", "down_proj")]
    return pieces


def hub_swiglu_experts(cfg: ModelShape, mop: str, hf: str) -> list[Piece]:
    """The hub's per-expert `mlp.experts.{e}.{gate,up,down}_proj` (Qwen3-MoE, GLM-4.5, DeepSeek-V3)."""
    return per_expert_pieces(cfg, mop, hf + "mlp.", ("gate_proj", "up_proj", "down_proj"))


def per_expert_pieces(cfg: ModelShape, mop: str, moe: str, names: tuple[str, str, str]) -> list[Piece]:
    """The router and one (gate, up, down) tensor triple per expert, under the HF prefix `moe`."""
    gate, up, down = names
    inter = cfg.expert_intermediate
    pieces = [Piece(mop + "router.weight", (), moe + "gate.weight")]
    for e in range(cfg.experts):
        expert = f"{moe}experts.{e}."
        pieces += [Piece(mop + "experts.w_gate_up", (e, slice(0, inter)), f"{expert}{gate}.weight"),
                   Piece(mop + "experts.w_gate_up", (e, slice(inter, 2 * inter)), f"{expert}{up}.weight"),
                   Piece(mop + "experts.w_down", (e,), f"{expert}{down}.weight")]
    return pieces
