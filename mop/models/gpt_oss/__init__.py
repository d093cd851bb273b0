"""gpt-oss (`GptOssForCausalLM`): grouped-query attention with biases on q, k, v and o, a learned
sink logit per head, sliding-window attention on the even blocks and full causal attention on the
odd ones (attention.py); YaRN RoPE without truncation; a biased top-k router whose weights are the
softmax of the chosen logits, and biased experts with a clamped SwiGLU (experts.py). No dense
blocks and no shared expert in the published models (mop builds them, HF cannot express them).

Everything else (norms, embedding, head, losses) is shared. The norms: gpt-oss's RMSNorm multiplies
its fp32 weight into the fp32 normalised input and casts once; mop's shared RMSNorm casts first.
Both are the same in fp32; in bf16 they differ by one rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop.models.attention import GQASpec
from mop.models.family import Family
from mop.models.gpt_oss import hf
from mop.models.gpt_oss.attention import gpt_oss_attention, layer_window
from mop.models.gpt_oss.experts import GptOssExperts, GptOssRouter
from mop.models.gpt_oss.options import Options
from mop.models.spec import ModelSpec


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    """`ModelSpec` with the router's bias and the experts' biases."""

    def expert_parameters(self) -> int:
        return super().expert_parameters() + 2 * self.cfg.expert_intermediate + self.cfg.hidden

    def router_parameters(self) -> int:
        return super().router_parameters() + self.cfg.experts

    def layer_windows(self) -> list[int | None]:
        return [layer_window(self.cfg, layer) for layer in range(self.cfg.blocks)]


FAMILY = Family("gpt_oss", attention=gpt_oss_attention,
                spec=lambda cfg: GptOssSpec(cfg, GQASpec.of(cfg, qkv_bias=cfg.options.attention_bias,
                                                          o_bias=cfg.options.attention_bias, sinks=True)),
                hf=hf.MAPPING, router=GptOssRouter, experts=GptOssExperts, options=Options)
