"""The [rl] settings: the automatic reference decided, and their checks against the rest of a run."""

from __future__ import annotations

import dataclasses

from mop.config import Config, ConfigError


def decide(config: Config) -> Config:
    """`rl.reference = "auto"`: with a KL term the base with the adapters off under LoRA, else
    precomputed; none without."""
    if config.rl.reference != "auto":
        return config
    reference = "none" if not config.rl.beta else "base" if config.adapters is not None else "precomputed"
    return dataclasses.replace(config, rl=dataclasses.replace(config.rl, reference=reference))


def check_settings(config: Config, world: int) -> None:
    """The [rl] settings' ranges, and what a rollouts run cannot do (one line each)."""
    if config.rl.prompts and config.data.format != "rollouts":
        raise ConfigError("data.format", f"'{config.data.format}': the RL loop (rl.prompts) trains on the rollouts it "
                          "samples; set --data.format=rollouts (mop rl sets it)")
    if config.data.format != "rollouts":
        return
    rl = config.rl
    if rl.prompts:
        check_loop(config)
    if rl.epsilon <= 0 or rl.epsilon_high < 0:
        raise ConfigError("rl.epsilon", f"must be > 0 (and rl.epsilon_high >= 0, 0: epsilon), got {rl.epsilon} and "
                          f"{rl.epsilon_high}")
    high = rl.epsilon_high or rl.epsilon
    if rl.delta and rl.delta <= 1 + high:
        raise ConfigError("rl.delta", f"caps the ratio from above: must be > 1 + epsilon_high = {1 + high} (0: no "
                          f"cap), got {rl.delta}")
    if rl.loss_type == "cispo" and not rl.epsilon_high:
        raise ConfigError("rl.epsilon_high", "CISPO caps the ratio at epsilon_high, and 0 would cap it at rl.epsilon "
                          f"= {rl.epsilon}, shrinking every token's weight; set it (TRL recommends 5.0)")
    if rl.loss_type == "cispo" and rl.delta:
        raise ConfigError("rl.delta", "caps the clipped losses' ratio; CISPO has its own cap (rl.epsilon_high): set "
                          "--rl.delta=0")
    if rl.correction.endswith("truncate") and not (rl.correction_min or rl.correction_max):
        raise ConfigError("rl.correction_max", f"rl.correction = '{rl.correction}' truncates into [correction_min, "
                          "correction_max] and both are 0 (none); set a bound or --rl.correction=none")
    if rl.beta < 0:
        raise ConfigError("rl.beta", f"must be >= 0, got {rl.beta}")
    if rl.max_completion_length < 1:
        raise ConfigError("rl.max_completion_length", f"must be >= 1, got {rl.max_completion_length}")
    if rl.correction_min < 0 or rl.correction_max < 0 or (rl.correction_max and rl.correction_min >= rl.correction_max):
        raise ConfigError("rl.correction_min", f"the correction's bounds must be >= 0 with min < max (0: none), got "
                          f"[{rl.correction_min}, {rl.correction_max}]")
    if rl.beta and rl.reference == "none":
        raise ConfigError("rl.reference", "rl.beta > 0 needs a reference; set --rl.reference=auto or --rl.beta=0")
    if not rl.beta and rl.reference in ("base", "precomputed"):
        raise ConfigError("rl.reference", f"'{rl.reference}': only the KL reads a reference, and rl.beta = 0; set "
                          "--rl.beta > 0 or --rl.reference=auto")
    if rl.reference == "base" and config.adapters is None:
        raise ConfigError("rl.reference", "'base' is the frozen base of a LoRA run; set --train.finetune=lora or "
                          "--rl.beta=0")
    if rl.reference == "base" and getattr(config.model.options, "router_bias_update_rate", 0):
        raise ConfigError("model.options.router_bias_update_rate", "moves the base's router biases, so the base "
                          "would drift from the reference; set it to 0")
    if rl.updates_per_batch < 1:
        raise ConfigError("rl.updates_per_batch", f"must be >= 1, got {rl.updates_per_batch}")
    if config.checkpoint.every % rl.updates_per_batch:
        raise ConfigError("checkpoint.every", f"{config.checkpoint.every} is not a multiple of rl.updates_per_batch="
                          f"{rl.updates_per_batch}: a checkpoint inside a batch's updates loses its old log-probs; "
                          "make it a multiple")
    if rl.replay == "old" and rl.updates_per_batch == 1:
        raise ConfigError("rl.replay", "'old' replays the batch's first step's routes on its later steps, and "
                          "rl.updates_per_batch = 1 has none; set --rl.updates_per_batch > 1 or --rl.replay=auto")
    if config.data.overlong != "drop":
        raise ConfigError("data.overlong", "a rollout is trained whole or not at all (a cut one is a trajectory the "
                          "engine never sampled); set --data.overlong=drop and a data.seq_len that holds them")
    if config.eval.every:
        raise NotImplementedError("eval.every: held-out evaluation of rollouts is not implemented; set --eval.every=0")


def check_loop(config: Config) -> None:
    """What the RL loop (rl.prompts, `mop.rl.feed`) needs beyond training on recorded rollouts."""
    rl = config.rl
    if rl.group < 2:
        raise ConfigError("rl.group", f"a prompt's advantages compare its group's rewards: must be >= 2, got "
                          f"{rl.group}")
    if rl.prompts_per_batch < 1:
        raise ConfigError("rl.prompts_per_batch", f"must be >= 1, got {rl.prompts_per_batch}")
    if rl.sync_bucket_mb < 1:
        raise ConfigError("rl.sync_bucket_mb", f"must be >= 1, got {rl.sync_bucket_mb}")
    if rl.reference == "precomputed":
        raise ConfigError("rl.reference", "'precomputed' covers recorded rollouts, and the RL loop samples new ones "
                          "every batch; set --rl.beta=0, or train LoRA (the KL's reference is then its base)")
    if rl.engine != "transformers" and not rl.engine_url:
        raise ConfigError("rl.engine_url", f"rl.engine = '{rl.engine}' samples from a running server: set its URL, "
                          "e.g. --rl.engine_url=http://localhost:8000")
    host, _, port = rl.sync_address.rpartition(":")
    if rl.engine != "transformers" and not (host and port.isdigit()):
        raise ConfigError("rl.sync_address", f"{rl.sync_address!r} is not host:port")
    if rl.engine == "sglang" and rl.sync == "folder":
        raise ConfigError("rl.sync", "'folder' is vLLM's reload (rl.engine = 'vllm'); SGLang takes the weights by "
                          "broadcast: set rl.sync = 'auto' or 'broadcast'")
    if rl.engine == "transformers" and rl.sync_dtype == "published":
        raise ConfigError("rl.sync_dtype", "'published' is for a server of the published checkpoint; the CPU engine "
                          "(rl.engine = 'transformers') loads the weights in bfloat16 or float32")
