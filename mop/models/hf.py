"""Hugging Face checkpoints <-> mop models: loading and saving, for every registered family.

The family's mapping (`mop.models.<family>.hf`, shared parts in `mop.models.hf_mapping`) says which
config.json keys make its `ModelConfig` and which checkpoint tensor holds each part of each
parameter (`Piece`s); this module reads and writes those pieces, family-independently.

Invariants: `HFWeights` (and `load_hf` through it) fills every element of every parameter from
exactly one checkpoint tensor and uses every tensor of the checkpoint, or raises; it reads slice
by slice (safetensors memory-maps the files), so a training rank reads only its own shards.
`load_hf(save_hf(m))` reproduces the parameters bit for bit and the config exactly (up to
mixtral's dense_intermediate, which its config.json cannot carry). Every problem a user can fix
raises `HFConversionError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mop.models.config import ModelConfig
from mop.models.families import FAMILIES
from mop.models.family import Family
from mop.models.hf_mapping import HFConversionError, Piece, model_pieces, shared_config_to_hf, stacked_experts_key
from mop.models.hf_quantized import reader_for
from mop.models.transformer import MoETransformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9
# safetensors' names of the floating dtypes a published checkpoint keeps unquantized tensors in
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
STORED_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "BOOL": 1}  # bytes per element of each safetensors dtype


# ---------------------------------------------------------------- config

NOT_KEPT = ("quantization_config", "pad_token_id")
"""The source's config.json keys an export drops: the weights written are not quantized unless `write_hf`
writes them as published (which adds its own `quantization_config`), and no pad id goes into config.json
(`mop.convert`: transformers would freeze that embedding row in a fine-tune)."""


def config_from_hf(source: str | Path | dict) -> ModelConfig:
    """The `ModelConfig` of a HF model directory, config.json file or parsed config dict."""
    hf = source if isinstance(source, dict) else read_hf_config(Path(source))
    cfg = ModelConfig.of(_family_of_type(hf.get("model_type")).hf.config_from_hf(hf))
    problems = cfg.validate()
    if problems:
        raise HFConversionError("config.json describes no valid mop model: " + "; ".join(f"{k} {m}" for k, m in problems))
    return cfg


def config_to_hf(cfg: ModelConfig, model_type: str | None = None, dtype: torch.dtype = torch.float32,
                 source: dict | None = None) -> dict:
    """The config.json dict of `cfg` as `model_type` (None: its own family's). `source`: the config.json
    the model's weights came from (`source_record`), whose every key mop does not write itself is kept
    (engines read keys transformers ignores: vLLM's DeepSeek-V3 router is built from `topk_method` and
    `scoring_func`), but for those `NOT_KEPT`; kept only when it is of the same family."""
    family = _expressible_family(cfg, model_type)
    cfg = replace(cfg, family=family.name)  # a config saved as another family it fits becomes one
    kept = {}
    if source is not None and model_types().get(source.get("model_type")) is family:
        kept = {key: value for key, value in source.items() if key not in NOT_KEPT}
    return {**kept, **shared_config_to_hf(cfg, family.hf.architecture, dtype), **family.hf.config_to_hf(cfg)}


def source_record(weights: "HFWeights") -> dict:
    """What a run keeps of the Hugging Face checkpoint its weights came from (`mop.checkpoint`'s
    `hf_source`): its directory, its fingerprint and its config.json, which exports keep
    (`config_to_hf`) and `--dtype=published` writes as (`AsPublished`)."""
    return {"path": str(weights.path.resolve()), "fingerprint": weights.fingerprint(), "config": weights.hf_config}


def open_recorded(record: dict, mtp: bool = False) -> tuple["HFWeights | None", str]:
    """The Hugging Face directory a record names (`{"path", "fingerprint"}`: `source_record`'s, or the MTP
    layers' with `mtp`, whose fingerprint covers their files too), opened if it is there unchanged; else None
    and what happened to it ("is gone", "has changed since")."""
    path = Path(record["path"])
    if not (path / "config.json").is_file():
        return None, "is gone"
    weights = HFWeights(path)
    if weights.fingerprint(mtp=mtp) != record["fingerprint"]:
        weights.__exit__()
        return None, "has changed since"
    return weights, ""


def open_source(record: dict, setting: str) -> "HFWeights":
    """The checkpoint of a `source_record`, opened and checked unchanged (`open_recorded`), or one line
    naming `setting`."""
    weights, problem = open_recorded(record)
    if weights is None:
        raise HFConversionError(f"{setting}: the weights came from {record['path']}, which {problem}; restore that "
                                "directory, or export in bfloat16 or float32")
    return weights


def model_types() -> dict[str, Family]:
    """The `model_type`s mop converts, each with its family: a family's name and its mapping's
    `model_types` (Kimi-K2's `kimi_k2` is deepseek_v3)."""
    return {kind: family for family in FAMILIES.values() for kind in (family.name, *family.hf.model_types)}


def _family_of_type(model_type) -> Family:
    """The family whose checkpoints have `model_type` (`model_types`)."""
    types = model_types()
    if model_type not in types:
        raise HFConversionError(
            f"config.json: model_type={model_type!r} is not supported; mop converts {', '.join(types)}")
    return types[model_type]


def _expressible_family(cfg: ModelConfig, model_type: str | None) -> Family:
    """`model_type`'s family (None: `cfg`'s own), after checking its HF model can express `cfg` exactly."""
    name = model_type or cfg.family
    if name not in FAMILIES:
        raise HFConversionError(f"model_type={name!r} is not supported; use one of {', '.join(FAMILIES)}")
    problems = FAMILIES[name].hf.inexpressible(cfg)
    if cfg.trained_mtp_layers and not FAMILIES[name].hf.mtp_layers:
        problems.append(f"model.mtp_layers={cfg.mtp_layers} (trained multi-token-prediction depths)")
    if problems:
        raise HFConversionError(f"cannot save as {name}: it has no equivalent of " + "; ".join(problems))
    return FAMILIES[name]


def read_hf_config(path: Path) -> dict:
    """The parsed config.json of a HF model directory (or of that file)."""
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



# ---------------------------------------------------------------- weights


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

    def __init__(self, path: str | Path, model: ModelConfig | None = None):
        """`model`: the model a run builds from it (None: config.json's), config.json's up to its loss
        weights: with `mtp_loss_coef` > 0 its MTP layers are read as the model's (`mtp_pieces`)."""
        self.path = Path(path)
        hf = read_hf_config(self.path)
        self.hf_config = hf
        self.cfg = model or config_from_hf(hf)
        self.quantized = reader_for(hf.get("quantization_config"), self.path / "config.json")
        self._stack = ExitStack()
        self.tensors = _open_checkpoint(self.path, self._stack)
        self.quantized.split(self.tensors, self.path)  # a quantized weight's scales are read with it
        # Multi-token-prediction layers (after the last block, in DeepSeek-V3 and GLM-4.5 checkpoints)
        # are not part of the model mop trains: kept aside (`MtpLayers` passes them through).
        mtp = FAMILIES[self.cfg.family].hf.mtp_layers
        self.mtp = {key: self.tensors.pop(key) for key in sorted(self.tensors)
                    if mtp and _layer_of(key) >= self.cfg.blocks}
        stacked = {i for i in range(self.cfg.blocks) if stacked_experts_key(i) in self.tensors}
        pieces = model_pieces(self.cfg, FAMILIES[self.cfg.family].hf, stacked)
        _check_keys(pieces, self.tensors, self.path)
        with torch.device("meta"):
            shapes = dict(_tensors(MoETransformer(self.cfg)))
        self.pieces: dict[str, list[Piece]] = {}
        for piece in pieces:
            file = self.tensors[piece.key][1]
            shape, expected = self.quantized.shape(self.tensors, piece.key), list(shapes[piece.param][piece.index].shape)
            if shape != expected:
                raise HFConversionError(f"{file}: {piece.key} has shape {shape} but config.json implies {expected}; "
                                        "the config and the weights are from different models")
            self.quantized.check(piece.key, shape, file)
            if piece.index == () and piece.param in self.pieces:
                continue  # a copy (an MTP layer's embedding and head, `mtp_pieces`): read once
            self.pieces.setdefault(piece.param, []).append(piece)

    def fingerprint(self, mtp: bool = False) -> dict[str, str]:
        """Per safetensors file of the model (with `mtp`, of the multi-token-prediction layers too):
        its size and a hash of its header (every tensor's name, dtype, shape and byte range), to
        tell a changed directory from the one imported. Weights rewritten in place with the same
        layout are not told apart."""
        entries = [*self.tensors.items(), *self.mtp.items()]  # the MTP layers' wherever they are read
        files = sorted({file for key, (_, file) in entries if mtp or _layer_of(key) < self.cfg.layers})
        return {file.name: f"{file.stat().st_size}:{_header_digest(file)}" for file in files}

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def rows(self, name: str, shape: torch.Size, first: int, count: int) -> torch.Tensor:
        out = torch.empty((count, *shape[1:]), dtype=torch.float32)
        read = self.quantized.rows
        for piece in self.pieces[name]:
            handle = self.tensors[piece.key][0]
            if piece.index == ():
                out.copy_(read(handle, piece.key, first, count))
            elif first <= piece.index[0] < first + count:
                out[(piece.index[0] - first, *piece.index[1:])] = read(handle, piece.key)
        return out


    def stored_rows(self, entry, shape: torch.Size, first: int, count: int) -> torch.Tensor | None:
        """Rows `[first, first + count)` of a parameter that holds a weight in a format
        (`mop.models.lora.StoredTensor`), as the checkpoint publishes them when it publishes the
        weight in that format (fp8 with the same blocks, MXFP4); None otherwise (the caller then
        quantizes the dequantized rows)."""
        if not entry.fmt.same_as(self.quantized.format) or entry.transposed:
            return None
        out = torch.empty((count, *shape[1:]), dtype=entry.fmt.stored_dtypes()[entry.companion])
        for piece in self.pieces[entry.weight]:
            handle = self.tensors[piece.key][0]
            if piece.index == ():
                part = self.quantized.published_rows(handle, piece.key, entry.companion, slice(first, first + count))
                if part is None:
                    return None
                out.copy_(part.view(out.dtype))  # the bytes as published (formats.BYTE_CARRIER)
            elif first <= piece.index[0] < first + count:
                part = self.quantized.published_rows(handle, piece.key, entry.companion)
                if part is None:
                    return None
                out[(piece.index[0] - first, *_stored_index(entry, piece.index[1:]))] = part.view(out.dtype)
        return out


def _stored_index(entry, index: tuple) -> tuple:
    """Where a per-expert piece's stored tensor sits in one expert of the stored parameter: its rows
    (a part of the weight's rows, `Fp8Blocks.parts`) or, for the scales, that part's blocks."""
    if entry.companion == 0 or not index:
        return index
    rows, total = index[0], entry.shape[-2]
    return (slice(entry.fmt.scale_offset(rows.start, total), entry.fmt.scale_offset(rows.stop, total)), *index[1:])


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
        for name, tensor in _tensors(model):
            tensor.copy_(weights.rows(name, tensor.shape, 0, tensor.shape[0]))
    return model


def empty_model(cfg: ModelConfig, dtype: torch.dtype) -> MoETransformer:
    """Parameters allocated once, in `dtype` and uninitialised: the checkpoint fills every element."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model = model.cast_parameters(dtype).to_empty(device="cpu")
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


def _tensors(model: MoETransformer) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of `model`: its parameters (a tied weight once) and its buffers."""
    return [*model.named_parameters(), *model.named_buffers()]


def _layer_of(key: str) -> int:
    """The block index of a `model.layers.{i}.` tensor; -1 for the others."""
    parts = key.split(".")
    return int(parts[2]) if key.startswith("model.layers.") and parts[2].isdigit() else -1


def _check_keys(pieces: list[Piece], tensors: dict, path: Path) -> None:
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
    """Write `model` (full, unsharded tensors) to the directory `path` as a HF checkpoint
    (`write_hf`; `dtype` None: the embedding's)."""
    state = model.state_dict()
    write_hf(model.cfg, path, lambda names: {name: state[name] for name in names},
             dtype or state["embed.weight"].dtype, model_type, max_shard_bytes, token_ids)


def write_hf(cfg: ModelConfig, path: str | Path, read, dtype: torch.dtype, model_type: str | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES, token_ids: dict[str, int] | None = None,
             published: "AsPublished | None" = None, mtp: "MtpLayers | None" = None,
             source: dict | None = None) -> None:
    """Write the model `cfg` describes to the directory `path` as a HF checkpoint, file by file:
    `read(names)` returns the whole tensors of those parameters and buffers, and is asked for one
    output file's at a time, so a process holds one file's tensors (and whole parameters spanning
    it), never the model.

    The tensors go in the hub layout every transformers version loads, cast to `dtype`, in
    `model.safetensors`, or in `model-0000k-of-0000n.safetensors` shards of at most
    `max_shard_bytes` (a bigger tensor gets a shard of its own) with an index. Tied weights are
    written once. `model_type` as in `config_to_hf`; `token_ids` (e.g. `eos_token_id`,
    `bos_token_id`) are added to config.json as they are. `published`: each tensor is written as a
    published base stores it (`AsPublished`: its format's data and scales under the base's names,
    and its `quantization_config`; the other tensors in the base's dtypes). `mtp`: a checkpoint's
    multi-token-prediction layers, passed through (`MtpLayers`: as published with `published`, else
    in `dtype`) in shards of their own after the model's, with its `num_nextn_predict_layers`.
    `source`: the config.json the weights came from, whose keys config.json keeps (`config_to_hf`).
    Buffers (the router's score-correction bias) are written in fp32 whatever `dtype` (`exported_dtype`).
    """
    family = _expressible_family(cfg, model_type)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    shapes = {name: tensor.shape for name, tensor in _tensors(model)}
    buffers = {name for name, _ in model.named_buffers()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    shards = _plan_shards(model_pieces(cfg, family.hf, set()), shapes, dtype, max_shard_bytes)
    mtp_dtype = None if published is not None else dtype
    extra = mtp.plan(mtp_dtype, max_shard_bytes) if mtp is not None else []
    count = len(shards) + len(extra)
    names = [SINGLE_FILE] if count == 1 else [f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = read(list(dict.fromkeys(piece.param for piece in shard)))
        out = {}
        for piece in shard:
            value = tensors[piece.param][piece.index]
            stored = published(piece.key, value) if published is not None else None
            written = _disk_tensor(value, exported_dtype(piece.param, buffers, dtype))
            out.update(stored if stored is not None else {piece.key: written})
        weight_map, total = _saved(out, path / name, weight_map, total)
        del tensors, out
    for name, keys in zip(names[len(shards):], extra):
        weight_map, total = _saved(mtp.read(keys, mtp_dtype), path / name, weight_map, total)
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # config.json goes last: a save interrupted earlier leaves no directory that looks loadable.
    config = {**config_to_hf(cfg, family.name, dtype, source), **(token_ids or {}),
              **({"quantization_config": published.config} if published is not None and published.config else {}),
              **({"num_nextn_predict_layers": mtp.layers} if mtp is not None else {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _saved(tensors: dict[str, torch.Tensor], file: Path, weight_map: dict, total: int) -> tuple[dict, int]:
    """Write one shard; the index's weight map (updated in place) and total size with it."""
    save_file(tensors, file, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, file.name))
    return weight_map, total + sum(t.numel() * t.element_size() for t in tensors.values())


class MtpLayers:
    """A Hugging Face checkpoint's multi-token-prediction layers (`HFWeights.mtp`), which mop keeps
    frozen and passes through to what it writes (`write_hf`): `layers` is the checkpoint's
    `num_nextn_predict_layers`; each tensor is read as published (the stored bytes and the scales,
    under their own names) or dequantized to fp32 and cast to the dtype written (a quantized
    weight's scales then go with it: the written model has no `quantization_config`)."""

    def __init__(self, weights: HFWeights):
        self.weights = weights
        self.layers = int(weights.hf_config.get("num_nextn_predict_layers") or 0)

    def read(self, keys: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The tensors of weights `keys` as written: `dtype` None: as published."""
        out = {}
        companions = getattr(self.weights.quantized, "companions", {})
        for key in keys:
            handle = self.weights.mtp[key][0]
            if dtype is not None:
                out[key] = self.weights.quantized.rows(handle, key).to(dtype).contiguous()
            elif key in companions:
                stored, scale, scale_handle = companions[key]
                out.update({stored: handle.get_tensor(stored), scale: scale_handle.get_tensor(scale)})
            else:
                out[key] = handle.get_tensor(key)
        return out

    def plan(self, dtype: torch.dtype | None, max_bytes: int) -> list[list[str]]:
        """The weights in shards of at most `max_bytes` (a bigger one alone), by their size as written."""
        shards, size = [[]], 0
        for key in self.weights.mtp:
            nbytes = self._nbytes(key, dtype)
            if shards[-1] and size + nbytes > max_bytes:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += nbytes
        return shards if shards[-1] else []

    def _nbytes(self, key: str, dtype: torch.dtype | None) -> int:
        if dtype is not None:
            return math.prod(self.weights.quantized.shape(self.weights.mtp, key)) * dtype.itemsize
        handle = self.weights.mtp[key][0]
        companions = getattr(self.weights.quantized, "companions", {})
        stored = [(handle, companions[key][0]), (companions[key][2], companions[key][1])] if key in companions else [
            (handle, key)]
        return sum(math.prod(h.get_slice(k).get_shape()) * STORED_BYTES[h.get_slice(k).get_dtype()] for h, k in stored)


class AsPublished:
    """Writes each tensor the way a published base does (`--dtype=published`), for a merge: the
    tensors `base` publishes in a format (`HFWeights.quantized`) quantized by `mop.models.formats`
    under the base's names (fp8: `<key>` and `<key>_scale_inv`; MXFP4: `<key>_blocks`, `<key>_scales`),
    every other one in the dtype the base stores it in."""

    def __init__(self, base: HFWeights):
        self.fmt, self.keys = base.quantized.format, set(getattr(base.quantized, "companions", {}))
        self.config = base.hf_config.get("quantization_config")
        self.dtypes = {key: SAFETENSORS_DTYPES.get(entry[0].get_slice(key).get_dtype())
                       for key, entry in base.tensors.items() if key not in self.keys}

    def __call__(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if key in self.keys:
            parts = zip(self.fmt.suffixes, self.fmt.quantize(value), self.fmt.published_dtypes())
            return {key + suffix: part.view(dtype).contiguous() for suffix, part, dtype in parts}
        dtype = self.dtypes.get(key)
        return None if dtype is None else {key: value.to(dtype).contiguous()}


def _remove_old_weights(path: Path) -> None:
    """Delete a previous save's weight files, so that no loader mixes its shards with the new ones."""
    for file in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        file.unlink(missing_ok=True)


def _nbytes(piece: Piece, shapes: dict[str, torch.Size], dtype: torch.dtype) -> int:
    shape = shapes[piece.param]
    return math.prod(shape[len(piece.index):]) * _indexed_rows(piece, shape) * dtype.itemsize


def _indexed_rows(piece: Piece, shape: torch.Size) -> int:
    """Elements of the leading indexed dims a piece covers (an int index: 1; a slice: its length)."""
    count = 1
    for index, size in zip(piece.index, shape):
        count *= len(range(size)[index]) if isinstance(index, slice) else 1
    return count


def _plan_shards(pieces: list[Piece], shapes: dict[str, torch.Size], dtype: torch.dtype,
                 max_bytes: int) -> list[list[Piece]]:
    shards, size = [[]], 0
    for piece in pieces:
        nbytes = _nbytes(piece, shapes, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += nbytes
    return shards


def exported_dtype(name: str, buffers: set[str], dtype: torch.dtype) -> torch.dtype:
    """The dtype mop tensor `name` is exported in: `dtype`, but fp32 for a buffer (the router's
    score-correction bias: fp32 in DeepSeek-V3's published checkpoint and in the engines, vLLM
    `deepseek_v2.py` and SGLang `deepseek_v2.py`; in bf16 its small differences would pick other
    experts)."""
    return torch.float32 if name in buffers else dtype


def _disk_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A copy even when nothing changes: safetensors refuses tensors that share storage, as the
    # per-expert slices of one stacked parameter do.
    return tensor.detach().to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format, copy=True)
