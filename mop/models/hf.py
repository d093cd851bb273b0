"""Hugging Face checkpoints <-> mop models, for the `qwen3_moe` and `mixtral` architectures.

Config (`config.json` key -> `ModelConfig` field):
    hidden_size -> hidden, num_hidden_layers -> layers, num_attention_heads -> heads,
    num_key_value_heads -> kv_heads, head_dim -> head_dim (default hidden / heads),
    vocab_size, rms_norm_eps -> norm_eps, rope_parameters.rope_theta or rope_theta -> rope_theta,
    num_experts_per_tok -> top_k, tie_word_embeddings -> tie_embeddings,
    initializer_range -> init_std, router_aux_loss_coef -> aux_loss_coef.
    qwen3_moe: num_experts (5.x writes num_local_experts) -> experts, moe_intermediate_size ->
        expert_intermediate, intermediate_size -> dense_intermediate, norm_topk_prob, qk_norm=True,
        mlp_only_layers / decoder_sparse_step -> dense_layers (only a dense prefix 0..k-1).
    mixtral: num_local_experts -> experts, intermediate_size -> expert_intermediate,
        norm_topk_prob=True, qk_norm=False, dense_layers=0 (dense_intermediate keeps its default,
        the one field a mixtral config.json cannot carry; it is unused without dense layers).
Features that would change the function computed (attention_bias, an active sliding window,
non-default RoPE, an activation other than silu) raise. Settings that touch training only are
ignored, as they do not change the model and mop's objective has none of them: attention_dropout,
mixtral's router_jitter_noise, and pad_token_id (HF's embedding freezes that row's gradient).
router_aux_loss_coef is mapped as is, although HF adds the aux loss only when called with
`output_router_logits=True`: mop's loss is HF's loss with that flag (for one sequence; HF pools
the load-balancing statistics over a batch, mop per sequence).

Weights (mop parameter <- checkpoint tensor), per layer i under `model.layers.{i}.`:
    embed.weight <- model.embed_tokens.weight; norm.weight <- model.norm.weight;
    lm_head.weight <- lm_head.weight (absent on disk when tied);
    attn_norm / mlp_norm <- input_layernorm / post_attention_layernorm;
    attention.{q,k,v,o}_proj, attention.{q,k}_norm <- self_attn.<same>;
    dense block mlp.{gate,up,down}_proj <- mlp.<same>;
    MoE block, hub layout (what the hub serves and what transformers 4.x and 5.x `save_pretrained`
    write; 5.x stacks the experts in memory only):
        qwen3_moe: mlp.router <- mlp.gate; expert e: w_gate_up[e, :I] <- mlp.experts.{e}.gate_proj,
            w_gate_up[e, I:] <- up_proj, w_down[e] <- down_proj
        mixtral: the same under block_sparse_moe., with w1 (gate), w3 (up), w2 (down);
    MoE block, stacked layout (transformers 5.x in-memory names, both architectures):
        mlp.router <- mlp.gate, w_gate_up <- mlp.experts.gate_up_proj, w_down <- mlp.experts.down_proj.

Invariants: `HFWeights` (and `load_hf` through it) fills every element of every parameter from
exactly one checkpoint tensor and uses every tensor of the checkpoint, or raises; it reads slice
by slice (safetensors memory-maps the files), so a training rank reads only its own shards. `load_hf(save_hf(m))` reproduces the
parameters bit for bit and the config exactly (up to mixtral's dense_intermediate, above).
Every problem a user can fix raises `HFConversionError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mop.models.config import ModelConfig
from mop.models.transformer import MoETransformer

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# The transformers class defaults for the keys a config.json may omit.
DEFAULTS = {
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "router_aux_loss_coef": 0.001},
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9


class HFConversionError(ValueError):
    """A Hugging Face config or checkpoint that mop cannot convert as it stands."""


# ---------------------------------------------------------------- config


def config_from_hf(source: str | Path | dict) -> ModelConfig:
    """The `ModelConfig` of a HF model directory, config.json file or parsed config dict."""
    hf = source if isinstance(source, dict) else _read_config(Path(source))
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFConversionError(
            f"config.json: model_type={model_type!r} is not supported; mop converts {' and '.join(ARCHITECTURES)}")
    _check_features(hf, model_type)
    heads = _required(hf, "num_attention_heads")
    common = dict(
        vocab_size=_required(hf, "vocab_size"),
        hidden=_required(hf, "hidden_size"),
        layers=_required(hf, "num_hidden_layers"),
        heads=heads,
        # Required: the two architectures default it differently (Qwen3-MoE to 4, Mixtral to 8).
        kv_heads=_required(hf, "num_key_value_heads"),
        head_dim=hf.get("head_dim") or _required(hf, "hidden_size") // heads,
        rope_theta=float(_rope_theta(hf, model_type)),
        norm_eps=float(_get(hf, "rms_norm_eps", model_type)),
        top_k=_required(hf, "num_experts_per_tok"),
        aux_loss_coef=float(_get(hf, "router_aux_loss_coef", model_type)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    if model_type == "qwen3_moe":
        specific = dict(
            # The hub and transformers 4.x write num_experts; 5.x writes its alias num_local_experts.
            experts=hf.get("num_experts", hf.get("num_local_experts")),
            expert_intermediate=_required(hf, "moe_intermediate_size"),
            dense_intermediate=_required(hf, "intermediate_size"),
            norm_topk_prob=bool(_get(hf, "norm_topk_prob", model_type)),
            qk_norm=True,
            dense_layers=_qwen3_dense_layers(hf, common["layers"]),
        )
        if specific["experts"] is None:
            raise HFConversionError("config.json lacks num_experts (or num_local_experts); add the expert count")
    else:
        specific = dict(experts=_required(hf, "num_local_experts"), expert_intermediate=_required(hf, "intermediate_size"),
                        norm_topk_prob=True, qk_norm=False, dense_layers=0)
    cfg = ModelConfig(**common, **specific)
    problems = cfg.validate()
    if problems:
        raise HFConversionError("config.json describes no valid mop model: " + "; ".join(f"{k} {m}" for k, m in problems))
    return cfg


def config_to_hf(cfg: ModelConfig, model_type: str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json dict of `cfg` as `model_type` (None: qwen3_moe if cfg.qk_norm else mixtral).

    Both `rope_theta` (read by transformers 4.x) and `rope_parameters` (5.x), and both `torch_dtype`
    and `dtype`, are written so that every transformers version reads the same model.
    """
    model_type = _expressible_type(cfg, model_type)
    dtype_name = str(dtype).removeprefix("torch.")
    hf = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
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
    if model_type == "qwen3_moe":
        hf.update(num_experts=cfg.experts, moe_intermediate_size=cfg.expert_intermediate,
                  intermediate_size=cfg.dense_intermediate, norm_topk_prob=cfg.norm_topk_prob,
                  mlp_only_layers=list(range(cfg.dense_layers)), decoder_sparse_step=1,
                  attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        hf.update(num_local_experts=cfg.experts, intermediate_size=cfg.expert_intermediate,
                  sliding_window=None, router_jitter_noise=0.0)
    return hf


def _read_config(path: Path) -> dict:
    file = path if path.suffix == ".json" else path / "config.json"
    if not file.is_file():
        raise HFConversionError(f"{file}: not found; point at a Hugging Face model directory holding config.json")
    return _read_json(file)


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HFConversionError(f"{file}: invalid JSON ({error}); re-download or re-save the checkpoint") from None
    if not isinstance(data, dict):
        raise HFConversionError(f"{file}: holds a JSON {type(data).__name__}, not an object; re-download or re-save "
                                "the checkpoint")
    return data


def _required(hf: dict, key: str):
    if hf.get(key) is None:
        raise HFConversionError(f"config.json lacks {key}, which fixes the {hf['model_type']} model's shapes; add it")
    return hf[key]


def _get(hf: dict, key: str, model_type: str):
    return hf.get(key, DEFAULTS[model_type][key])


def _rope_theta(hf: dict, model_type: str) -> float:
    # transformers 5.x reads rope_parameters first and falls back to the 4.x top-level rope_theta.
    return (hf.get("rope_parameters") or {}).get("rope_theta", _get(hf, "rope_theta", model_type))


def _check_features(hf: dict, model_type: str) -> None:
    """Raise on config settings that change the function the HF model computes and mop cannot."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"config.json: hidden_act={hf['hidden_act']!r}; mop's experts use silu only")
    if hf.get("attention_bias"):
        raise HFConversionError("config.json: attention_bias=true; mop's attention projections have no bias")
    # Qwen3-MoE ignores sliding_window unless use_sliding_window is set; Mixtral applies it whenever set.
    if hf.get("sliding_window") is not None and (model_type == "mixtral" or hf.get("use_sliding_window")):
        raise HFConversionError(
            f"config.json: sliding_window={hf['sliding_window']} is active; mop has full causal attention only")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"config.json: rope_type={rope_type!r}; mop implements the default RoPE only")


def _qwen3_dense_layers(hf: dict, layers: int) -> int:
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


def _expressible_type(cfg: ModelConfig, model_type: str | None) -> str:
    """`model_type`, or the one picked for `cfg`, after checking it can express `cfg` exactly."""
    model_type = model_type or ("qwen3_moe" if cfg.qk_norm else "mixtral")
    if model_type not in ARCHITECTURES:
        raise HFConversionError(f"model_type={model_type!r} is not supported; use one of {', '.join(ARCHITECTURES)}")
    problems = []
    if cfg.shared_expert_intermediate:
        problems.append(f"model.shared_expert_intermediate={cfg.shared_expert_intermediate} (a shared expert)")
    if model_type == "qwen3_moe" and not cfg.qk_norm:
        problems.append("model.qk_norm=false (qwen3_moe always normalises q and k; mixtral does not)")
    if model_type == "mixtral":
        if cfg.qk_norm:
            problems.append("model.qk_norm=true (mixtral has no q/k norm; qwen3_moe has)")
        if not cfg.norm_topk_prob:
            problems.append("model.norm_topk_prob=false (mixtral always renormalises; qwen3_moe need not)")
        if cfg.dense_layers:
            problems.append(f"model.dense_layers={cfg.dense_layers} (mixtral has no dense layers; qwen3_moe has)")
    if problems:
        raise HFConversionError(f"cannot save as {model_type}: it has no equivalent of " + "; ".join(problems))
    return model_type


# ---------------------------------------------------------------- weights


@dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor and the part of a mop parameter it holds."""

    param: str
    index: tuple
    """Index into the mop parameter; () for the whole parameter."""
    key: str


def _pieces(cfg: ModelConfig, model_type: str, stacked_layers: set[int]) -> list[_Piece]:
    """The checkpoint tensors of a model, MoE layers in `stacked_layers` in the stacked layout."""
    pieces = [_Piece("embed.weight", (), "model.embed_tokens.weight"), _Piece("norm.weight", (), "model.norm.weight")]
    if not cfg.tie_embeddings:
        pieces.append(_Piece("lm_head.weight", (), "lm_head.weight"))
    for layer in range(cfg.layers):
        pieces += _block_pieces(cfg, model_type, layer, layer in stacked_layers)
    return pieces


def _block_pieces(cfg: ModelConfig, model_type: str, layer: int, stacked: bool) -> list[_Piece]:
    mop, hf = f"layers.{layer}.", f"model.layers.{layer}."
    pieces = [_Piece(mop + "attn_norm.weight", (), hf + "input_layernorm.weight"),
              _Piece(mop + "mlp_norm.weight", (), hf + "post_attention_layernorm.weight")]
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
    pieces += [_Piece(f"{mop}attention.{name}.weight", (), f"{hf}self_attn.{name}.weight") for name in attention]
    if layer < cfg.dense_layers:
        return pieces + [_Piece(f"{mop}mlp.{name}.weight", (), f"{hf}mlp.{name}.weight")
                         for name in ("gate_proj", "up_proj", "down_proj")]
    if stacked:
        return pieces + [_Piece(mop + "mlp.router.weight", (), hf + "mlp.gate.weight"),
                         _Piece(mop + "mlp.experts.w_gate_up", (), hf + "mlp.experts.gate_up_proj"),
                         _Piece(mop + "mlp.experts.w_down", (), hf + "mlp.experts.down_proj")]
    return pieces + _hub_expert_pieces(cfg, model_type, mop + "mlp.", hf)


def _hub_expert_pieces(cfg: ModelConfig, model_type: str, mop: str, hf: str) -> list[_Piece]:
    moe, (gate, up, down) = (
        (hf + "block_sparse_moe.", ("w1", "w3", "w2")) if model_type == "mixtral"
        else (hf + "mlp.", ("gate_proj", "up_proj", "down_proj")))
    inter = cfg.expert_intermediate
    pieces = [_Piece(mop + "router.weight", (), moe + "gate.weight")]
    for e in range(cfg.experts):
        expert = f"{moe}experts.{e}."
        pieces += [_Piece(mop + "experts.w_gate_up", (e, slice(0, inter)), f"{expert}{gate}.weight"),
                   _Piece(mop + "experts.w_gate_up", (e, slice(inter, 2 * inter)), f"{expert}{up}.weight"),
                   _Piece(mop + "experts.w_down", (e,), f"{expert}{down}.weight")]
    return pieces


class HFWeights:
    """Rows of mop parameters read from a HF model directory: tensor slices, never a whole model.

    Opening checks that the checkpoint holds exactly the tensors config.json implies, each of the
    shape it implies (metadata only; no tensor data is read). `rows(name, shape, first, count)`
    then reads rows `[first, first + count)` (dim 0) of mop parameter `name` as fp32: a slice of
    the tensor for a whole-parameter piece (safetensors reads only those rows of the memory-mapped
    file), or the whole tensors of the experts in that range in the hub's per-expert layout.
    A rank that materialises its shards from it (`mop.parallel.materialize.write_rows`) reads only
    what it holds. Use as a context manager (it keeps the files open).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        hf = _read_config(self.path)
        self.cfg = config_from_hf(hf)
        self._stack = ExitStack()
        self.tensors = _open_checkpoint(self.path, self._stack)
        stacked = {i for i in range(self.cfg.layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in self.tensors}
        pieces = _pieces(self.cfg, hf["model_type"], stacked)
        _check_keys(pieces, self.tensors, self.path)
        with torch.device("meta"):
            shapes = {name: param for name, param in MoETransformer(self.cfg).named_parameters()}
        self.pieces: dict[str, list[_Piece]] = {}
        for piece in pieces:
            handle, file = self.tensors[piece.key]
            shape, expected = list(handle.get_slice(piece.key).get_shape()), list(shapes[piece.param][piece.index].shape)
            if shape != expected:
                raise HFConversionError(f"{file}: {piece.key} has shape {shape} but config.json implies {expected}; "
                                        "the config and the weights are from different models")
            self.pieces.setdefault(piece.param, []).append(piece)

    def fingerprint(self) -> dict[str, str]:
        """Per safetensors file: its size and a hash of its header (every tensor's name, dtype,
        shape and byte range), to tell a changed directory from the one imported. Weights
        rewritten in place with the same layout are not told apart."""
        files = sorted({file for _, file in self.tensors.values()})
        return {file.name: f"{file.stat().st_size}:{_header_digest(file)}" for file in files}

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def rows(self, name: str, shape: torch.Size, first: int, count: int) -> torch.Tensor:
        out = torch.empty((count, *shape[1:]), dtype=torch.float32)
        for piece in self.pieces[name]:
            handle = self.tensors[piece.key][0]
            if piece.index == ():
                out.copy_(handle.get_slice(piece.key)[first:first + count])
            elif first <= piece.index[0] < first + count:
                out[(piece.index[0] - first, *piece.index[1:])] = handle.get_tensor(piece.key)
        return out


def _header_digest(file: Path) -> str:
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")  # safetensors: u64 header size, then JSON
        return hashlib.sha256(handle.read(length)).hexdigest()[:16]


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> MoETransformer:
    """A CPU `MoETransformer` in `dtype` holding the weights of the HF model directory `path` (one
    process, the whole model: for tests and `mop convert`; training ranks read their shards only).

    Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`, with each
    MoE layer's experts in the hub (per-expert) or the stacked layout.
    """
    with HFWeights(path) as weights, torch.no_grad():
        model = empty_model(weights.cfg, dtype)
        for name, param in model.named_parameters():
            param.copy_(weights.rows(name, param.shape, 0, param.shape[0]))
    return model


def empty_model(cfg: ModelConfig, dtype: torch.dtype) -> MoETransformer:
    """Parameters allocated once, in `dtype` and uninitialised: the checkpoint fills every element."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model = model.to(dtype).to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module a fresh Parameter, which unties the head
    return model


def _open_checkpoint(path: Path, stack: ExitStack) -> dict[str, tuple]:
    """Every tensor key of the checkpoint -> (open safetensors handle, file); nothing read yet."""
    if (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    elif (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFConversionError(f"{path / INDEX_FILE}: has no weight_map; re-download or re-save the checkpoint")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise HFConversionError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; mop reads safetensors checkpoints only "
                                "(re-save .bin weights with save_pretrained)")
    tensors = {}
    for file in files:
        if not file.is_file():
            raise HFConversionError(f"{path / INDEX_FILE}: lists {file.name}, which is missing; download every shard")
        try:
            handle = stack.enter_context(safe_open(file, framework="pt"))
        except (SafetensorError, OSError) as error:
            raise HFConversionError(f"{file}: not a readable safetensors file ({error}); re-download or re-save it") from None
        for key in handle.keys():
            if key in tensors:
                raise HFConversionError(f"{file}: {key} is also in {tensors[key][1]}; the checkpoint is inconsistent")
            tensors[key] = (handle, file)
    return tensors


def _check_keys(pieces: list[_Piece], tensors: dict, path: Path) -> None:
    expected = {piece.key for piece in pieces}
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing:
        raise HFConversionError(f"{path}: checkpoint lacks {len(missing)} tensor(s) config.json implies, e.g. "
                                f"{missing[0]}; the config and the weights are from different models")
    if unexpected:
        raise HFConversionError(f"{path}: checkpoint has {len(unexpected)} tensor(s) config.json does not explain, "
                                f"e.g. {unexpected[0]} (check tie_word_embeddings, num_hidden_layers, the expert count)")


def save_hf(model: MoETransformer, path: str | Path, dtype: torch.dtype | None = None, model_type: str | None = None,
            max_shard_bytes: int = MAX_SHARD_BYTES, token_ids: dict[str, int] | None = None) -> None:
    """Write `model` (full, unsharded tensors) to the directory `path` as a HF checkpoint.

    The tensors go in the hub layout every transformers version loads, cast to `dtype` (None:
    the embedding's dtype), in `model.safetensors`, or in `model-0000k-of-0000n.safetensors`
    shards of at most `max_shard_bytes` (a bigger tensor gets a shard of its own) with an index.
    Tied weights are written once. `model_type` as in `config_to_hf`; `token_ids` (e.g.
    `eos_token_id`, `bos_token_id`) are added to config.json as they are.
    """
    model_type = _expressible_type(model.cfg, model_type)
    state = model.state_dict()
    dtype = dtype or state["embed.weight"].dtype
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    shards = _plan_shards(_pieces(model.cfg, model_type, set()), state, dtype, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file({piece.key: _disk_tensor(state[piece.param][piece.index], dtype) for piece in shard},
                  path / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(piece, state, dtype) for shard in shards for piece in shard)},
                 "weight_map": {piece.key: name for name, shard in zip(names, shards) for piece in shard}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # config.json goes last: a save interrupted earlier leaves no directory that looks loadable.
    config = {**config_to_hf(model.cfg, model_type, dtype), **(token_ids or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _remove_old_weights(path: Path) -> None:
    """Delete a previous save's weight files, so that no loader mixes its shards with the new ones."""
    for file in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        file.unlink(missing_ok=True)


def _nbytes(piece: _Piece, state: dict, dtype: torch.dtype) -> int:
    return state[piece.param][piece.index].numel() * dtype.itemsize


def _plan_shards(pieces: list[_Piece], state: dict, dtype: torch.dtype, max_bytes: int) -> list[list[_Piece]]:
    shards, size = [[]], 0
    for piece in pieces:
        nbytes = _nbytes(piece, state, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += nbytes
    return shards


def _disk_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A copy even when nothing changes: safetensors refuses tensors that share storage, as the
    # per-expert slices of one stacked parameter do.
    return tensor.detach().to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format, copy=True)
