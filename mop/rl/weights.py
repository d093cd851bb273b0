"""The trainer's weights exported for an inference engine: buckets of `(hf_name, tensor)` in the
base checkpoint's names and layout, gathered from the run's shards once, never the whole model on
a rank.

Algorithm (`weight_buckets`, every rank calls it: it is collective; the host optimizer's last updates
are settled first): the model's checkpoint tensors
(`mop.models.hf_mapping.model_pieces`, the hub layout every engine loads: per-expert tensors where
the family publishes them) in checkpoint order, grouped by the mop parameter (or buffer) that holds
them. For each parameter, one reduce over the world gives rank 0 its whole tensor in the export dtype:
every rank contributes a zero tensor of the global shape with its own rows written where it is
their owner (`GlobalViews.owns`: a replicated copy once), so the sum is exact. Rank 0 cuts the
parameter into its checkpoint tensors (contiguous copies) and adds them to the open bucket, which it
yields once the next unit would take it past `bucket_bytes`; a unit is a tensor, or a layer's
attention, which a bucket never splits (`sync_unit`), and one bigger than a bucket gets one of its
own. The other ranks yield nothing.
Buffers (a router's score-correction bias) are the same on every rank: rank 0 takes its own, in fp32
whatever the export dtype (`mop.models.hf.exported_dtype`).

Memory per rank: one parameter's whole tensor in the export dtype (the reduce's buffer, released
before the next; gloo's reduce adds a temporary of its size, and the owner's rows are cast once), and
on rank 0 the open bucket: about one bucket plus one to two times a layer's largest stacked tensor
(its experts) or its attention, whatever the model's size (`mop bench rl-sync`). Communication: each parameter once, in the
export dtype (bf16: half of fp32's bytes).

In a published format (`published`: `mop.models.hf.AsPublished` of the Hugging Face folder the run's
weights came from, e.g. DeepSeek-V3's fp8 checkpoint imported with `mop convert from-hf`): each
parameter is gathered in fp32, and each checkpoint tensor the base publishes quantized is sent
re-quantized (fp8 e4m3 with its block scales as `<key>` and `<key>_scale_inv`; MXFP4 experts as
`<key>_blocks` and `<key>_scales`), every other one in the dtype the base stores it in: what an engine
serving the published checkpoint takes (it quantizes nothing itself: a bf16 weight sent to vLLM's fp8
layer is cast into its fp8 storage and the old scale kept, `mop.rl.senders`), the trainer's weights
quantized as the base's publisher quantized its own. `sync_form` decides the form for the RL loop
(`rl.sync_dtype`) and `engine_config` writes the config.json that goes with it.

A LoRA run exports its base with the adapters merged in (`W + alpha/r B A` in fp32, `mop convert merge`'s
arithmetic): each adapted weight's adapters are gathered like any parameter, and rank 0 reads the base
weight whole from the run's base (its Hugging Face folder, dequantized as the model computes with it,
or its initial values) and merges them; any format above then applies (`published`: the merged weight
re-quantized as the base publishes it). `write_adapters` sends the adapters alone in PEFT's layout
with the engines' in its `serve/`, for an engine that serves the base and loads adapters (vLLM's and
SGLang's LoRA APIs load `serve/`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mop.build import TrainingRun, base_weights
from mop.config import ConfigError
from mop.models.families import family_of
from mop.models.hf import AsPublished, config_to_hf, exported_dtype, open_source
from mop.models.hf_mapping import Piece, model_pieces
from mop.models.lora import adapted_weights
from mop.models.lora import merged as lora_merged
from mop.models.served_adapters import save_adapters
from mop.models.transformer import MoETransformer
from mop.parallel.checkpointing import canonical_name
from mop.parallel.materialize import initial_values

Bucket = list[tuple[str, torch.Tensor]]


def weight_buckets(run: TrainingRun, bucket_bytes: int, dtype: torch.dtype = torch.bfloat16,
                   published: AsPublished | None = None) -> Iterator[Bucket]:
    """The run's weights as buckets of `(hf_name, tensor)` on rank 0, none on the others, in `dtype` or, with
    `published`, in the base's published format (a LoRA run's: its base with the adapters merged in; module
    docstring); every rank iterates it to the end."""
    bucket, size = [], 0
    for _, parts in itertools.groupby(_sent(run, dtype, published), key=lambda part: part[0]):
        tensors = [item for _, sent in parts for item in sent.items()]
        nbytes = sum(tensor.nbytes for _, tensor in tensors)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += tensors
        size += nbytes
    if bucket:
        yield bucket


def sync_unit(key: str) -> str:
    """What a bucket never splits: a layer's attention (SGLang fuses DeepSeek-V3's q_a_proj and
    kv_a_proj_with_mqa only when one `load_weights` call brings both, and loads neither otherwise,
    silently: `models/deepseek_weight_loader.py`), else the checkpoint tensor itself."""
    layer, _, rest = key.partition(".self_attn.")
    return layer + ".self_attn" if rest else key


def _sent(run: TrainingRun, dtype: torch.dtype, published: AsPublished | None) -> Iterator[tuple[str, dict]]:
    """Each checkpoint tensor as sent (`_as_sent`) with its `sync_unit`, in checkpoint order, on rank 0; the
    other ranks take part in the gathers and yield nothing."""
    run.optimizer.synchronize()  # the host optimizer's last updates, settled into the device weights
    cfg = run.config.model
    main = run.runtime.rank == 0
    buffers = {canonical_name(name) for name, _ in run.model.named_buffers()}
    with base_weights(run.config) as base:
        whole_of = _merged(run, base) if run.config.adapters is not None else _trained(run)
        for name, pieces in _by_tensor(model_pieces(cfg, family_of(cfg).hf, set())):
            sent_dtype = exported_dtype(name, buffers, dtype)
            whole = whole_of(name, sent_dtype if published is None else torch.float32)
            for piece in pieces if main else ():
                yield sync_unit(piece.key), _as_sent(piece.key, whole[piece.index], sent_dtype, published)
            del whole


def sync_form(run: TrainingRun, choice: str, server: bool) -> tuple[torch.dtype, AsPublished | None]:
    """The dtype and published format (`weight_buckets`) of `rl.sync_dtype` = `choice` for a run's engine
    (`server`: a vLLM or SGLang server, which holds a quantized checkpoint as published); every rank agrees
    (the gathers' dtype follows)."""
    source = run.hf_source
    quantized = source is not None and bool(source["config"].get("quantization_config"))
    if choice == "published" or (choice == "auto" and server and quantized):
        if source is None:
            raise ConfigError("rl.sync_dtype", "'published' sends the weights as the Hugging Face checkpoint they came "
                              "from publishes them, and this run's did not come from one (mop convert from-hf, or "
                              "lora.base): set rl.sync_dtype = bfloat16")
        with open_source(source, "rl.sync_dtype") as weights:
            return torch.bfloat16, AsPublished(weights)
    if choice == "auto":  # a server computes in bf16; the CPU engine as the run does
        return (torch.float32 if not server and run.config.compute_dtype == torch.float32 else torch.bfloat16), None
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[choice], None


def engine_config(run: TrainingRun, dtype: torch.dtype, published: AsPublished | None = None) -> dict:
    """The config.json of the weights `weight_buckets` exports: the run's model over every other key of the
    checkpoint its weights came from (`config_to_hf`), and with `published` that checkpoint's
    `quantization_config`."""
    config = config_to_hf(run.config.model, dtype=dtype, source=run.hf_source and run.hf_source["config"])
    if published is not None and published.config:
        config["quantization_config"] = published.config
    return config


def adapter_tensors(run: TrainingRun) -> dict[str, torch.Tensor]:
    """A LoRA run's adapters, each whole in fp32 on rank 0 (collective; empty on the other ranks, which keep
    no gathered buffer past its reduce)."""
    run.optimizer.synchronize()
    main, adapters = run.runtime.rank == 0, {}
    for name, tensor in run.model.named_parameters():
        if tensor.requires_grad:
            whole = _gathered(run, tensor, torch.float32)
            if main:
                adapters[canonical_name(name)] = whole
    return adapters


def write_adapters(run: TrainingRun, path: str | Path, dtype: torch.dtype) -> Path:
    """A sender of a LoRA run's adapters alone: PEFT's folder (`mop.models.peft`, what `mop convert to-peft`
    writes) with the engines' layout in its `serve/` (`mop.models.served_adapters`: what vLLM's and
    SGLang's LoRA loading take), written by rank 0; collective."""
    adapters = adapter_tensors(run)
    if run.runtime.rank == 0:
        save_adapters(path, run.config.model, run.config.adapters, adapters, dtype)
    return Path(path)


def _trained(run: TrainingRun):
    """Full fine-tuning: each parameter whole on rank 0, gathered from its owners (module docstring)."""
    tensors = {canonical_name(n): t for n, t in (*run.model.named_parameters(), *run.model.named_buffers())}
    return lambda name, dtype: _gathered(run, tensors[name], dtype)


def _merged(run: TrainingRun, base):
    """LoRA: each base weight whole on rank 0 as the run's base holds it (`base`: its Hugging Face folder,
    dequantized; None: its initial values), with the adapters, gathered, merged in (`W + alpha/r B A` in
    fp32, as `mop convert merge`); the buffers as the model holds them."""
    config = run.config
    with torch.device("meta"):
        adapted = MoETransformer(config.model, config.adapters)
    updates = adapted_weights(adapted)
    params = {canonical_name(n): t for n, t in run.model.named_parameters()}
    buffers = {canonical_name(n): t for n, t in run.model.named_buffers()}
    if base is None and config.lora.base_format not in ("none", "auto"):
        raise NotImplementedError(f"exporting a LoRA run whose base is its initial weights stored as "
                                  f"lora.base_format = '{config.lora.base_format}' is not implemented; export a run "
                                  "on a published base (lora.base) or with lora.base_format = 'none'")
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in MoETransformer(config.model).state_dict().items()}
    rows = base.rows if base is not None else initial_values(config.train.seed, config.model.init_std)
    main = run.runtime.rank == 0

    def whole(name: str, dtype: torch.dtype) -> torch.Tensor | None:
        if name in buffers:
            return buffers[name].detach().to(dtype)
        update = updates.get(name)
        if update is not None:  # every rank: the adapters' gathers are collective
            a, b = (_gathered(run, params[key], torch.float32) for key in (update.lora_a, update.lora_b))
        if not main:
            return None
        weight = rows(name, shapes[name], 0, shapes[name][0])
        if update is not None:
            weight = lora_merged(weight, a, b, config.adapters.scaling, update.transposed)
        return weight.to(dtype)

    return whole


def _as_sent(key: str, value: torch.Tensor, dtype: torch.dtype, published: AsPublished | None) -> dict:
    """A checkpoint tensor as the engine takes it: contiguous host copies, in `dtype` or as published."""
    value = value.to(device="cpu", memory_format=torch.contiguous_format, copy=True)
    sent = published(key, value) if published is not None else None
    return sent if sent is not None else {key: value.to(dtype)}


def _by_tensor(pieces: list[Piece]) -> list[tuple[str, list[Piece]]]:
    """The pieces grouped by the mop tensor that holds them, in checkpoint order."""
    grouped: dict[str, list[Piece]] = {}
    for piece in pieces:
        grouped.setdefault(piece.param, []).append(piece)
    return list(grouped.items())


def _gathered(run: TrainingRun, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole `tensor` in `dtype` on rank 0 (module docstring); a zero tensor elsewhere."""
    layout, views = run.runtime.layout, run.views
    if not isinstance(tensor, torch.nn.Parameter):  # a buffer: every rank holds all of it
        return tensor.detach().to(dtype)
    if layout is None:
        return tensor.detach().to(dtype)
    whole = torch.zeros(views.global_shape(tensor), dtype=dtype, device=run.runtime.device)
    if views.owns(tensor):
        local = views.local(tensor).detach()
        first = views.first_row(tensor)
        whole[first:first + len(local)] = local.to(dtype)
    dist.reduce(whole, dst=0, group=layout.world_group)
    return whole


def write_folder(buckets: Iterator[Bucket], run: TrainingRun, path: str | Path, dtype: torch.dtype,
                 published: AsPublished | None = None) -> Path:
    """A sender: the buckets as a Hugging Face checkpoint folder (`save_folder`, with the base's
    `quantization_config` when they are `published`), written by rank 0; every rank iterates the buckets."""
    return save_folder(buckets, path, engine_config(run, dtype, published) if run.runtime.rank == 0 else None)


def save_folder(buckets: Iterable[Bucket], path: str | Path, config: dict | None) -> Path:
    """The buckets as a Hugging Face checkpoint folder: one safetensors file per bucket, then the index and
    `config` as config.json (None: neither, a rank without buckets)."""
    path = Path(path)
    weight_map = {}
    for number, bucket in enumerate(buckets):
        name = f"model-{number + 1:05d}.safetensors"
        path.mkdir(parents=True, exist_ok=True)
        save_file(dict(bucket), path / name, metadata={"format": "pt"})
        weight_map.update({key: name for key, _ in bucket})
    if config is not None:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
