"""A LoRA run's base and its checks: what `train.finetune = "lora"` decides, reads and records.

The model side (adapters, the frozen base in its published format) is `mop.models.lora`; here:
- `decide(config)`: with `lora.base` (a Hugging Face model directory) the model is the base's
  (config.json), unless [model] is set, then it must be the same; `lora.base_format = "auto"`
  becomes the base's published format (its `quantization_config`: fp8 block scales, MXFP4
  experts), or "none" for an unquantized or random base;
- `check_settings`: the LoRA settings' own ranges, targets that match a module, and the settings
  that cannot carry LoRA;
- `base_identity`: what the base is, recorded in every LoRA checkpoint (`lora_base`) and checked by
  a resume (`check_resume`) and a merge: a Hugging Face directory and its fingerprint (every
  safetensors file's size and header), or the run's own initial weights (seed, init_std).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from mop.config import Config, ConfigError
from mop.models.config import ModelConfig
from mop.models.hf import HFWeights, config_from_hf, read_hf_config
from mop.models.hf_mapping import HFConversionError
from mop.models.hf_quantized import reader_for
from mop.models.lora import LoraConfig, format_name, is_adapter, unmatched_targets
from mop.models.transformer import MoETransformer


def decide(config: Config) -> Config:
    """The model and base format a LoRA run's base implies (module docstring); other runs as they are."""
    if config.adapters is None:
        return config
    lora, model = config.lora, config.model
    published = None
    if lora.base:
        hf = _base_config(lora.base)
        base_model = _hf_model(hf)
        if model != ModelConfig() and model != base_model:
            key = next(f.name for f in dataclasses.fields(model)
                       if getattr(model, f.name) != getattr(base_model, f.name))
            raise ConfigError(f"model.{key}", f"is {getattr(model, key)!r} but the base {lora.base} has "
                              f"{getattr(base_model, key)!r}; leave [model] unset to take the base's")
        model = base_model
        published = _published_format(hf, lora.base)
    if lora.base_format == "auto":
        lora = dataclasses.replace(lora, base_format=format_name(published))
    return dataclasses.replace(config, model=model, lora=lora)


def _base_config(base: str) -> dict:
    try:
        return read_hf_config(Path(base))
    except HFConversionError as err:
        raise ConfigError("lora.base", str(err)) from None


def _hf_model(hf: dict) -> ModelConfig:
    try:
        return config_from_hf(hf)
    except HFConversionError as err:
        raise ConfigError("lora.base", str(err)) from None


def _published_format(hf: dict, base: str):
    """The format the base's quantized weights are published in (None: unquantized)."""
    try:
        return reader_for(hf.get("quantization_config"), Path(base) / "config.json").format
    except HFConversionError as err:
        raise ConfigError("lora.base", str(err)) from None


def check_settings(config: Config, world: int) -> None:
    """The LoRA settings' own checks (none for full fine-tuning, whose [lora] is not read)."""
    lora = config.adapters
    if lora is None:
        return
    for key, message in lora.validate():
        raise ConfigError(f"lora.{key}", message)
    if lora.base_format == "auto":
        raise ConfigError("lora.base_format", "is decided when the settings are resolved (mop.resolve)")
    unmatched = _unmatched(config.model, lora)
    if unmatched:
        raise ConfigError("lora.targets", f"{unmatched[0]!r} matches no module of this {config.model.family} model; "
                          "use the kinds attention, dense_mlp, shared_experts, routed_experts or a module name "
                          "(q_proj, ...)")
    if config.parallel.fsdp_cpu_offload:
        raise ConfigError("parallel.fsdp_cpu_offload", "cannot carry LoRA's frozen base (FSDP2's CPU offload keeps "
                          "trainable shards); use --optim.offload=true")


@functools.lru_cache(maxsize=8)
def _unmatched(model: ModelConfig, lora: LoraConfig) -> list[str]:
    with torch.device("meta"):
        return unmatched_targets(MoETransformer(model), lora)


def base_identity(config: Config) -> dict | None:
    """What a LoRA run's base is (module docstring); None for full fine-tuning."""
    lora = config.adapters
    if lora is None:
        return None
    if not lora.base:
        return {"kind": "initial", "seed": config.train.seed, "init_std": config.model.init_std}
    path = Path(lora.base).resolve()
    with HFWeights(path) as weights:
        return {"kind": "hf", "path": str(path), "fingerprint": weights.fingerprint()}


def describe_base(identity: dict) -> str:
    if identity["kind"] == "initial":
        return f"the run's initial weights (seed {identity['seed']}, init_std {identity['init_std']})"
    return f"{identity['path']}"


def check_resume(meta: dict, config: Config, base: dict | None, path: Path) -> None:
    """A checkpoint resumes only a run of its own kind (full or LoRA) and, for LoRA, on its own base
    with adapters of its shape."""
    saved = meta.get("lora_base")
    if base is None and saved is not None:
        raise ConfigError("train.finetune", f"checkpoint {path} holds LoRA adapters only; resume it with "
                          "--train.finetune=lora, or merge them into the base with mop convert merge")
    if base is None:
        return
    if saved is None:
        raise ConfigError("checkpoint.resume", f"{path} is not a LoRA checkpoint; a LoRA run reads its base from "
                          "lora.base and resumes LoRA checkpoints only")
    if saved != base:
        raise ConfigError("lora.base", f"checkpoint {path} trained its adapters on {describe_base(saved)}, this run's "
                          f"base is {describe_base(base)}; set --lora.base to the checkpoint's base")
    old = meta["config"].get("lora", {})
    for key in ("rank", "alpha", "targets", "base_format"):  # the adapters' shape, and the base they adapt
        if old.get(key) != getattr(config.lora, key):
            raise ConfigError(f"lora.{key}", f"checkpoint {path} was saved with lora.{key}={old.get(key)!r}, this run "
                              f"has {getattr(config.lora, key)!r}; use the checkpoint's")


DEVICE_ADAMW_LIMIT = 1 << 30
"""Bytes of torch AdamW's device state (fp32 weights, gradients and two moments: 16 per parameter) a
rank's adapters may take before `optim.offload = "auto"` moves their state to the host optimizer."""


def adapters_on_host(config: Config, world: int) -> bool:
    """`optim.offload = "auto"` for a LoRA run under "mop": the host optimizer only when the adapters'
    device AdamW state on the most loaded rank would pass DEVICE_ADAMW_LIMIT (small adapters keep
    torch AdamW on the device, which has no overlap machinery to pay for)."""
    from mop.parallel.placement import (
        placements,  # the layout's record, built only for this decision
    )

    p = config.parallel
    if config.adapters.validate():  # settings out of range: `check_settings` names them in one line
        return False
    record = placements(config.model, world, p.expert or 1, p.vocab or 1, config.adapters)
    local = sum(place.local_rows * place.row_elements for name, place in record.items() if is_adapter(name))
    return 16 * local > DEVICE_ADAMW_LIMIT


def summary(model: torch.nn.Module, config: Config) -> str:
    """The start line's account of a LoRA run (this rank's shards): what trains, the base's format, and the
    device bytes per base and per adapter parameter."""
    from torch.distributed.tensor import DTensor

    base_bytes = base_params = adapter_bytes = adapter_params = 0
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if param.requires_grad:
            adapter_bytes, adapter_params = adapter_bytes + local.nbytes, adapter_params + local.numel()
        else:
            base_bytes += local.nbytes
            base_params += _weights_held(name, local)
    with torch.device("meta"):
        full = MoETransformer(config.model, config.adapters)
    trained = sum(p.numel() for p in full.parameters() if p.requires_grad)
    total = sum(_weights_held(n, p) for n, p in full.named_parameters() if not p.requires_grad)
    lora = config.lora
    per_base, per_adapter = base_bytes / max(base_params, 1), adapter_bytes / max(adapter_params, 1)
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {lora.targets}: {trained:,} parameters train over a "
            f"frozen base of {total:,} ({trained / max(total, 1):.3%}), base {lora.base_format} from "
            f"{lora.base or 'the initial weights'}; device bytes per base parameter {per_base:.3g}, per adapter "
            f"parameter {per_adapter:.3g}")


def _weights_held(name: str, tensor: torch.Tensor) -> int:
    """The base's weights a frozen tensor holds: a format's scales hold none, MXFP4's codes two a byte."""
    if name.endswith(("_scale_inv", "_scales")):
        return 0
    return tensor.numel() * (2 if name.endswith("_blocks") else 1)
