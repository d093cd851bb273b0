"""Mixtral (`MixtralForCausalLM`): grouped-query attention without q/k norm, a softmax top-k MoE
that always renormalises, no dense layers. Its modules are the shared ones."""

from mop.models.attention import Attention, GQASpec
from mop.models.family import Family
from mop.models.mixtral import hf
from mop.models.spec import ModelSpec

FAMILY = Family("mixtral", attention=lambda cfg, layer: Attention(cfg),
                spec=lambda cfg: ModelSpec(cfg, GQASpec.of(cfg)),
                hf=hf.MAPPING)
