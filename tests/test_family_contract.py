"""Every registered family holds to the contract `mop/models/README.md` writes down (issue 37): each
`Family` and `HFMapping` field present and of its declared type, its options a frozen dataclass with
a docstring under every field, and its spec and mapping answering for a small model of it; the
family table of docs/model-families.md lists exactly the registry. A sixth family that forgets a piece fails
here, not in a user's conversion."""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import torch

from mop.config import field_docs
from mop.models.config import ModelConfig
from mop.models.families import FAMILIES, model_spec
from mop.models.family import Family
from mop.models.hf import config_from_hf, config_to_hf
from mop.models.hf_mapping import HFMapping, Piece
from mop.models.spec import ModelSpec
from mop.models.transformer import MoETransformer

MODEL_FAMILIES = Path(__file__).resolve().parents[1] / "docs" / "model-families.md"
# The fields a small model of each family needs beyond the defaults (latent attention has no grouped heads).
SHAPES = {"deepseek_v3": dict(kv_heads=4, head_dim=24, dense_layers=1, options={"qk_rope_head_dim": 8}),
          "gpt_oss": dict(qk_norm=False, options={"sliding_window": 4})}


def small(name: str) -> ModelConfig:
    shape = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4,
                 expert_intermediate=16)
    return ModelConfig(family=name, **{**shape, **SHAPES.get(name, {})})


def holds(value, kind) -> bool:
    """Whether `value` is of the declared type `kind` (callables by their origin, tuples by their items)."""
    origin = typing.get_origin(kind)
    if origin is collections.abc.Callable:
        return callable(value)
    if origin is tuple:
        return isinstance(value, tuple) and all(holds(item, typing.get_args(kind)[0]) for item in value)
    if origin in (typing.Union, types.UnionType):
        return any(holds(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    return isinstance(value, origin or kind)


def declared(cls) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_and_its_mapping_have_every_declared_field_of_its_type(name):
    family = FAMILIES[name]
    assert isinstance(family, Family) and family.name == name
    for field, kind in declared(Family):
        assert holds(getattr(family, field), kind), f"{name}: Family.{field} is {getattr(family, field)!r}"
    assert isinstance(family.hf, HFMapping), f"{name}: Family.hf is no HFMapping"
    for field, kind in declared(HFMapping):
        assert holds(getattr(family.hf, field), kind), f"{name}: HFMapping.{field} is {getattr(family.hf, field)!r}"
    assert family.hf.architecture.endswith("ForCausalLM")


@pytest.mark.parametrize("name", sorted(name for name, family in FAMILIES.items() if family.options is not None))
def test_the_options_are_a_frozen_dataclass_documented_field_by_field(name):
    options = FAMILIES[name].options
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
    docs = field_docs(options)
    assert [f.name for f in dataclasses.fields(options) if not docs.get(f.name)] == [], name
    assert ModelConfig(family=name).options == options()  # the registry builds them, with their defaults


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_spec_and_the_mapping_answer_for_a_small_model(name):
    cfg = small(name)
    assert cfg.validate() == []
    spec = model_spec(cfg)
    assert isinstance(spec, ModelSpec)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    assert spec.total_parameters == sum(p.numel() for p in model.parameters())
    mapping = FAMILIES[name].hf
    pieces = [piece for layer in range(cfg.layers) for piece in mapping.block_pieces(cfg, layer, True)]
    assert pieces and all(isinstance(piece, Piece) for piece in pieces)
    assert isinstance(mapping.inexpressible(cfg), list)
    hf = config_to_hf(cfg, name) if not mapping.inexpressible(cfg) else None
    if hf is not None:
        assert hf["model_type"] == name and hf["architectures"] == [mapping.architecture]
        assert config_from_hf(hf).family == name


def test_the_family_page_lists_the_registered_families():
    listed = re.findall(r"^\| `(\w+)` \|", MODEL_FAMILIES.read_text(encoding="utf-8"), flags=re.M)
    assert listed == list(FAMILIES)
