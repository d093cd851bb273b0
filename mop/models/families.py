"""The registry of model families: `model.family` -> `Family`. A new family is a folder and a line here."""

from __future__ import annotations

from mop.models import mixtral, qwen3_moe
from mop.models.config import ModelConfig
from mop.models.family import Family
from mop.models.spec import ModelSpec

FAMILIES: dict[str, Family] = {family.name: family for family in (qwen3_moe.FAMILY, mixtral.FAMILY)}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The shape facts of `cfg`: parameter counts, FLOPs, activation widths and bytes."""
    return family_of(cfg).spec(cfg)
