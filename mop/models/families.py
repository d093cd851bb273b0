"""The registry of model families: `model.family` -> `Family`, and the family's `Options` built from a
table (`family_options`). A new family is a folder and a line here (README.md beside this file)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from mop.models import deepseek_v3, glm4_moe, gpt_oss, mixtral, qwen3_moe
from mop.models.family import Family
from mop.models.shape import ModelShape
from mop.models.spec import ModelSpec

FAMILIES: dict[str, Family] = {family.name: family for family in (
    qwen3_moe.FAMILY, mixtral.FAMILY, glm4_moe.FAMILY, deepseek_v3.FAMILY, gpt_oss.FAMILY)}


def unknown_family(name: str) -> str:
    return f"{name!r} is not a model family; use one of {', '.join(FAMILIES)}"


def family_options(family: str, given):
    """`given` (None, a table read from a config or a checkpoint, or an options object) as the options
    dataclass of `family`; what does not fit is returned as it is, for `ModelConfig.validate` to name."""
    kind = FAMILIES[family].options if family in FAMILIES else None
    if kind is not None and isinstance(given, kind):
        return given
    if given is None or given == {} or is_dataclass(given) and given == type(given)():  # unset, or another family's defaults
        return kind() if kind else None
    if kind is not None and isinstance(given, dict) and set(given) <= {f.name for f in fields(kind)}:
        return kind(**given)
    return given


def family_of(cfg: ModelShape) -> Family:
    return FAMILIES[cfg.family]


def model_spec(cfg: ModelShape) -> ModelSpec:
    """The shape facts of `cfg`: parameter counts, FLOPs, activation widths and bytes."""
    return family_of(cfg).spec(cfg)
