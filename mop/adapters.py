"""A LoRA run once built: what its base is, the checks a resume makes, its start line.

The model side (adapters, the frozen base in its published format) is `mop.models.lora`, what the
settings decide and check `mop.settle.adapters`; here:
- `base_identity`: what the base is, recorded in every LoRA checkpoint (`lora_base`) and checked by
  a resume (`check_resume`) and a merge: a Hugging Face directory and its fingerprint (every
  safetensors file's size and header), or the run's own initial weights (seed, init_std);
- `summary`: the start line's account of what trains over which base.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mop.config import Config, ConfigError
from mop.models.hf import HFWeights
from mop.models.transformer import MoETransformer


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
