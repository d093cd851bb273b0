"""The [dpo] settings: the automatic reference decided, and their checks against the rest of a run."""

from __future__ import annotations

import dataclasses

from mop.config import Config, ConfigError


def decide(config: Config) -> Config:
    """`dpo.reference = "auto"`: the base with the adapters off under LoRA, else precomputed."""
    if config.dpo.reference != "auto":
        return config
    reference = "base" if config.adapters is not None else "precomputed"
    return dataclasses.replace(config, dpo=dataclasses.replace(config.dpo, reference=reference))


def check_settings(config: Config, world: int) -> None:
    """DPO's own ranges, and what a preference run cannot do (one line each)."""
    if config.data.format != "preference":
        return
    dpo = config.dpo
    if dpo.beta <= 0:
        raise ConfigError("dpo.beta", f"must be > 0, got {dpo.beta}")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise ConfigError("dpo.label_smoothing", f"must be in [0, 0.5), got {dpo.label_smoothing}")
    if dpo.label_smoothing and dpo.loss == "ipo":
        raise ConfigError("dpo.label_smoothing", "applies to loss = 'sigmoid' only; set it to 0 with dpo.loss = 'ipo'")
    if dpo.nll_alpha < 0:
        raise ConfigError("dpo.nll_alpha", f"must be >= 0, got {dpo.nll_alpha}")
    if dpo.reference == "base" and config.adapters is None:
        raise ConfigError("dpo.reference", "'base' is the frozen base of a LoRA run; set --train.finetune=lora or "
                          "--dpo.reference=precomputed")
    if dpo.reference == "base" and getattr(config.model.options, "router_bias_update_rate", 0):
        raise ConfigError("model.options.router_bias_update_rate", "moves the base's router biases, so the base "
                          "would drift from the reference; set it to 0 or --dpo.reference=precomputed")
    if config.eval.every:
        raise NotImplementedError("eval.every: held-out evaluation of preference pairs is not implemented; "
                                  "set --eval.every=0")
