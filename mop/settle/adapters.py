"""A LoRA run's settings: what `train.finetune = "lora"` decides from its base, and their checks.

- `decide(config)`: with `lora.base` (a Hugging Face model directory) the model is the base's
  (config.json), unless [model] is set, then it must be the same; `lora.base_format = "auto"`
  becomes the base's published format (its `quantization_config`: fp8 block scales, MXFP4
  experts), or "none" for an unquantized or random base;
- `adapters_on_host`: `optim.offload = "auto"`'s rule for a LoRA run;
- `check_settings`: the LoRA settings' own ranges, targets that match a module, and the settings
  that cannot carry LoRA.
What a LoRA run records and checks once built (its base's identity, a resume's) is `mop.adapters`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from mop.config import Config, ConfigError
from mop.models.config import ModelConfig
from mop.models.hf import config_from_hf, read_hf_config
from mop.models.hf_mapping import HFConversionError
from mop.models.hf_quantized import reader_for
from mop.models.lora import LoraConfig, format_name, is_adapter, unmatched_targets
from mop.models.transformer import MoETransformer
from mop.parallel.placement import placements


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
        raise ConfigError("lora.base_format", "is decided when the settings are settled (mop.settle)")
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


DEVICE_ADAMW_LIMIT = 1 << 30
"""Bytes of torch AdamW's device state (fp32 weights, gradients and two moments: 16 per parameter) a
rank's adapters may take before `optim.offload = "auto"` moves their state to the host optimizer."""


def adapters_on_host(config: Config, world: int) -> bool:
    """`optim.offload = "auto"` for a LoRA run under "mop": the host optimizer only when the adapters'
    device AdamW state on the most loaded rank would pass DEVICE_ADAMW_LIMIT (small adapters keep
    torch AdamW on the device, which has no overlap machinery to pay for)."""
    p = config.parallel
    if config.adapters.validate():  # settings out of range: `check_settings` names them in one line
        return False
    record = placements(config.model, world, p.expert or 1, p.vocab or 1, config.adapters)
    local = sum(place.local_rows * place.row_elements for name, place in record.items() if is_adapter(name))
    return 16 * local > DEVICE_ADAMW_LIMIT
