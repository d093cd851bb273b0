"""Qwen3-MoE (`Qwen3MoeForCausalLM`): grouped-query attention with q/k RMSNorm, a softmax top-k MoE
with optional renormalisation, optional dense first layers. Its modules are the shared ones."""

from mop.models.attention import Attention, GQASpec
from mop.models.family import Family
from mop.models.qwen3_moe import hf
from mop.models.spec import ModelSpec

FAMILY = Family("qwen3_moe", attention=lambda cfg, layer: Attention(cfg),
                spec=lambda cfg: ModelSpec(cfg, GQASpec.of(cfg)),
                hf=hf.MAPPING)
