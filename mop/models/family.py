"""What a model family is: its attention, its shape spec and its HF mapping, in one folder.

A family folder (`mop/models/<family>/`, registered in `mop.models.families`; README.md says what it
owns) exports one `Family`; the hyper-parameters only it has are its `options` dataclass
(`model.options` in a config), so a new family adds no field to the shared `ModelShape`.
The shared layers (`mop.models.layers`: norms, RoPE, SwiGLU; `mop.models.moe`: the router and the
stacked experts; `mop.models.attention`: grouped-query attention) stay shared; a block takes its
attention from the family (`mop.models.transformer.Block`). The family's name is `model.family`
in a run's config and the `model_type` of its HF checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from mop.models.hf_mapping import HFMapping
from mop.models.moe import Experts, Router
from mop.models.shape import ModelShape
from mop.models.spec import ModelSpec


@dataclass(frozen=True)
class Family:
    name: str
    """`model.family` and the HF `model_type`."""
    attention: Callable[[ModelShape, int], nn.Module]
    """Builds block `layer`'s attention: `(cfg, layer) -> module(x, position_ids, documents)` with a
    `core` seam (gpt_oss alternates sliding-window and full blocks)."""
    spec: Callable[[ModelShape], ModelSpec]
    """The shape facts of a config of this family."""
    hf: HFMapping
    """Its Hugging Face config and checkpoint mapping."""
    router: Callable[[ModelShape], nn.Module] = Router
    """Builds one MoE layer's router: `(cfg) -> module(x [T, H]) -> (fp32 probabilities [T, E] the
    balance statistics sum, weights [T, k], expert ids [T, k])`."""
    experts: Callable[[ModelShape], nn.Module] = Experts
    """Builds one MoE layer's routed experts: `(cfg) -> module(x [T, H], expert_ids [T, k], weights
    [T, k]) -> [T, H]`, the seam expert parallelism replaces (the shared stacked SwiGLU by default)."""
    options: type | None = None
    """Its own hyper-parameters beyond `ModelShape`'s shared ones: a frozen dataclass with a docstring
    per field (and, optionally, `validate(model_config) -> [(key, message)]`), set as `[model.options]` in a config
    and `--model.options.KEY=VALUE`; `mop train --help` lists them per family. None: it has none."""
