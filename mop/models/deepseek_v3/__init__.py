"""DeepSeek-V3 and Kimi-K2 (`DeepseekV3ForCausalLM`; Kimi-K2 is this architecture with another
config): multi-head latent attention (attention.py) with optional q LoRA, YaRN and interleaved
RoPE; DeepSeek-V3's routing (fp32 sigmoid scores, a score-correction bias for selection only,
group-limited top-k, `routed_scaling_factor`) with shared experts and dense first layers.

`model.head_dim` is the q/k head width, `qk_nope_head_dim + qk_rope_head_dim` (192 for
DeepSeek-V3); `model.kv_heads` equals `model.heads` (latent attention has no grouped heads).
Balancing: DeepSeek-V3 pre-trains with auxiliary-loss-free balancing (the score-correction bias
moved by `model.options.router_bias_update_rate`, 0 = frozen, the fine-tuning default) plus a tiny
sequence-wise balance loss (alpha 1e-4, per layer). HF's model has no auxiliary loss, so imports set
`aux_loss_coef` 0; a nonzero `model.aux_loss_coef` trains mop's per-sequence load-balancing loss on
this router's normalised scores, pooled over the MoE layers as HF's loss is (DeepSeek's is per layer).
"""

from __future__ import annotations

from mop.models.deepseek_v3 import hf
from mop.models.deepseek_v3.attention import MLASpec, MultiHeadLatentAttention
from mop.models.deepseek_v3.options import Options
from mop.models.family import Family
from mop.models.spec import ModelSpec

FAMILY = Family("deepseek_v3", attention=lambda cfg, layer: MultiHeadLatentAttention(cfg),
                spec=lambda cfg: ModelSpec(cfg, MLASpec.of(cfg)),
                hf=hf.MAPPING, router=lambda cfg: cfg.options.router(cfg), options=Options)
