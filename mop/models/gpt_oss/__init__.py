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

from mop.models.config import ModelConfig
from mop.models.family import Family
from mop.models.gpt_oss import hf
from mop.models.attention import GQASpec
from mop.models.gpt_oss.attention import gpt_oss_attention, layer_window
from mop.models.gpt_oss.experts import GptOssExperts, GptOssRouter
from mop.models.rope import YarnOptions
from mop.models.spec import ModelSpec


@dataclass(frozen=True)
class Options(YarnOptions):
    yarn_truncate: bool = False
    """Round the ramp's correction dims outwards (`truncate`); gpt-oss does not."""
    sliding_window: int = 128
    """Keys a query of a sliding-window block (the even ones) sees, itself included (`sliding_window`)."""
    attention_bias: bool = True
    """Biases on the q, k, v and o projections (`attention_bias`)."""
    swiglu_limit: float = 7.0
    """The experts clamp the gate above and the up projection on both sides at this value."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' gate, `gate * sigmoid(alpha * gate)`."""

    def validate(self, model: ModelConfig) -> list[tuple[str, str]]:
        problems = self.yarn_problems()
        if self.sliding_window < 1:
            problems.append(("sliding_window", f"must be >= 1, got {self.sliding_window}"))
        for key in ("swiglu_limit", "swiglu_alpha"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        if not model.norm_topk_prob:
            problems.append(("norm_topk_prob", "gpt_oss's router always softmaxes the top-k logits: set "
                                               "model.norm_topk_prob = true"))
        return problems


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    """`ModelSpec` with the router's bias and the experts' biases."""

    def expert_parameters(self) -> int:
        return super().expert_parameters() + 2 * self.cfg.expert_intermediate + self.cfg.hidden

    def router_parameters(self) -> int:
        return super().router_parameters() + self.cfg.experts

    def layer_windows(self) -> list[int | None]:
        return [layer_window(self.cfg, layer) for layer in range(self.cfg.layers)]


FAMILY = Family("gpt_oss", attention=gpt_oss_attention,
                spec=lambda cfg: GptOssSpec(cfg, GQASpec.of(cfg, qkv_bias=cfg.options.attention_bias,
                                                          o_bias=cfg.options.attention_bias, sinks=True)),
                hf=hf, router=GptOssRouter, experts=GptOssExperts, options=Options)
