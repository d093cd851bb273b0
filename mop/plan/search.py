"""Which layout: every legal MoP layout and every FSDP2 baseline configuration, scored.

MoP candidates (`parallel.strategy = "mop"`, bf16, one sequence per data group and micro-batch
unless the global batch holds more): D over the divisors of the world that divide the heads
(Ulysses may cross nodes: at 1M tokens one node's 8 ranks can be too few), Ep and P over the
divisors of a node's GPUs (expert and vocabulary groups stay on NVLink, as the runtime's automatic
degrees do), attention head chunks and LLEP chunks in {1, 2, 4, 8}, the logits kept or recomputed
(`parallel.vocab_logits`), activation checkpointing none / full / full + offload, the host
optimizer on or off (torch AdamW on the device), and the micro-batch. Every candidate is a real
`Config`, resolved and validated by the plain rules (`mop.settle.rules.resolve`: every check `mop
train` runs, without the fit to a memory budget, which is what this search replaces) for the world
size and a node's ranks, so the chosen layout is one the trainer accepts.

FSDP2 baseline candidates, the paper's Table 2 axes: context parallelism CP (Ulysses, the
baseline's `parallel.sequence`), expert parallelism EP (standard, no LLEP), tensor parallelism TP
(Megatron-style with sequence parallelism, which `mop train`'s fsdp2 strategy does not have: the
planner models it, see `mop.cost.activations.shapes`), FSDP2's CPU offload, and activation
checkpointing (without activation offload, which TorchTitan does not have); FSDP over the
remaining ranks (W / (CP TP), TorchTitan's dp_shard).

The pick: among the candidates whose device peak fits the GPU's budget and whose host memory
fits the node, those within 2% of the highest predicted tokens/s/GPU (the roofline cannot tell
them apart), and of those the one with the smallest device peak (the most headroom).
"""

from __future__ import annotations

import itertools

from mop.config import Config, ConfigError, apply
from mop.cost.candidates import OPTIMIZERS, Choice, choose, divisors, evaluate
from mop.cost.cluster import Cluster
from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig
from mop.parallel.mesh import LayoutError
from mop.settle.rules import resolve

CHUNKS = (1, 2, 4, 8)
MEMORY_OPTIONS = {"none": ("none", False), "ac": ("full", False), "ac+offload": ("full", True)}
# The paper's FSDP-best sweeps activation checkpointing but not activation offload (TorchTitan has none).
BASELINE_MEMORY_OPTIONS = {"none": ("none", False), "ac": ("full", False)}


# What each objective `mop plan` plans sets beyond supervised training's (`--dpo`, `--grpo`).
OBJECTIVES = {
    "sft": {},
    # DPO on pairs packed with the prompt once (the reference: LoRA's base in every step, else precomputed)
    "dpo": {"data": {"format": "preference"}},
    # GRPO on packed rollouts, their routes replayed (with rl.beta under LoRA: the base's forward in every step)
    "grpo": {"data": {"format": "rollouts"}},
}


def base_config(model: ModelConfig, context: int, lora: LoraConfig | None = None,
                objective: dict | None = None) -> Config:
    """bf16 on CUDA at `context` tokens per sequence, training `objective` (`OBJECTIVES`' settings,
    None: supervised)."""
    finetune = "full" if lora is None else "lora"
    objective = objective or {}
    return apply(Config(model=model, lora=lora or LoraConfig()),
                 {**objective, "data": {"seq_len": context, **objective.get("data", {})},
                  "train": {"dtype": "bfloat16", "device": "cuda", "finetune": finetune}})


def _settle(config: Config, cluster: Cluster, global_batch: int, micro_batch: int, tp: int = 1) -> Config | None:
    """The config with its batch set (one sequence per micro-batch and data group unless
    `global_batch` is given), validated for the cluster; None when the trainer would refuse it.
    Under the baseline's tensor parallelism a data group is CP x TP ranks; the trainer, which has no
    TP, counts CP groups, so its global batch is the sequences x tp (its micro-batch count is then
    the TP baseline's)."""
    groups = cluster.world // (config.parallel.sequence * tp)
    sequences = global_batch or groups * micro_batch
    if sequences % (groups * micro_batch):
        return None
    config = apply(config, {"train": {"micro_batch": micro_batch, "global_batch": sequences * tp}})
    try:
        return resolve(config, world=cluster.world, local_world=cluster.gpus_per_node)
    except (ConfigError, LayoutError):
        return None


def mop_configs(model: ModelConfig, cluster: Cluster, context: int, global_batch: int = 0,
                lora: LoraConfig | None = None, objective: dict | None = None):
    world, node = cluster.world, cluster.gpus_per_node
    base = base_config(model, context, lora, objective)
    for d in (d for d in divisors(world) if model.heads % d == 0 and context % d == 0):
        batches = [1] if not global_batch else [b for b in divisors(max(1, global_batch * d // world)) if b <= 8]
        for ep, vocab, logits, head_chunks, llep_chunks, memory, optimizer, micro in itertools.product(
                [e for e in divisors(node) if model.experts % e == 0],
                [1] if model.tie_embeddings else divisors(node), ("keep", "recompute"),
                [c for c in CHUNKS if (model.heads // d) % c == 0 and (d > 1 or c == 1)],
                CHUNKS, MEMORY_OPTIONS.values(), OPTIMIZERS.values(), batches):
            if ep == 1 and llep_chunks > 1:
                continue
            config = apply(base, {
                "parallel": dict(strategy="mop", nproc=node, sequence=d, expert=ep, vocab=vocab, expert_balance="llep",
                                 vocab_logits=logits, attention_head_chunks=head_chunks, llep_chunks=llep_chunks),
                "train": dict(activation_checkpointing=memory[0], offload_activations=memory[1]),
                "optim": dict(offload=optimizer[0], speculative=optimizer[1])})
            settled = _settle(config, cluster, global_batch, micro)
            if settled is not None:
                yield settled, 1


def fsdp2_configs(model: ModelConfig, cluster: Cluster, context: int, global_batch: int = 0,
                  lora: LoraConfig | None = None, objective: dict | None = None):
    world, node = cluster.world, cluster.gpus_per_node
    base = base_config(model, context, lora, objective)
    for cp, ep, tp, offload, memory in itertools.product(
            [d for d in divisors(world) if model.heads % d == 0 and context % d == 0],
            [e for e in divisors(world) if model.experts % e == 0],
            [t for t in divisors(node) if model.heads % t == 0 and model.kv_heads % t == 0],
            (False, True), BASELINE_MEMORY_OPTIONS.values()):
        if world % (cp * tp) or world % (ep * tp) or (model.heads // tp) % cp:
            continue
        config = apply(base, {
            "parallel": dict(strategy="fsdp2", nproc=node, sequence=cp, expert=ep, vocab=1, expert_balance="ep",
                             fsdp_cpu_offload=offload),
            "train": dict(activation_checkpointing=memory[0], offload_activations=memory[1]),
            "optim": dict(offload=False)})
        settled = _settle(config, cluster, global_batch, 1, tp)
        if settled is not None:
            yield settled, tp


def plan(model: ModelConfig, cluster: Cluster, context: int, global_batch: int = 0, routing_skew: float = 1.0,
         document_tokens: int = 0, lora: LoraConfig | None = None, objective: dict | None = None) -> dict[str, Choice]:
    """The best MoP layout and the best FSDP2 baseline for one context (with `lora`: LoRA runs;
    `objective`: `OBJECTIVES`' settings, None: supervised training)."""
    def scored(configs):
        return [evaluate(c, cluster, tp, routing_skew, document_tokens) for c, tp in configs]

    mop = scored(mop_configs(model, cluster, context, global_batch, lora, objective))
    fsdp2 = scored(fsdp2_configs(model, cluster, context, global_batch, lora, objective))
    if not mop or not fsdp2:
        raise ConfigError("--global-batch", f"{global_batch} sequences per step divide over no "
                          f"{'MoP' if not mop else 'FSDP2'} layout of {cluster.world} ranks; use a multiple of "
                          f"{cluster.world} or 0 (each layout's smallest)")
    return {"mop": choose(mop), "fsdp2_best": choose(fsdp2)}
