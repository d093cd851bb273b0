"""The plain rules: raw settings in, one frozen resolved config out, for a world of ranks.

`resolve(config, world, local_world)`:
1. each feature's decisions: a LoRA run's model and base format from its base
   (`mop.settle.adapters.decide`), every objective's automatic settings (`mop.objectives`: DPO's
   reference); the model's shape is checked (`ModelConfig.validate`), then every automatic setting is
   decided:
   `parallel.nproc` (one rank per visible GPU on CUDA, 2 on the CPU, 1 for the reference
   strategy), the degrees D, Ep and P (under "mop" the largest that fit the model and divide one
   node's ranks, so every group stays on a node's fast links; 1 otherwise),
   `parallel.expert_balance` and `optim.offload` (under "mop" the host optimizer, but for LoRA
   adapters small enough for torch AdamW on the device, `mop.settle.adapters.adapters_on_host`), and
   the memory settings by their plain rules (no head or LLEP chunks, no checkpointing or offload,
   the logits kept, up to 4 sequences per micro-batch);
2. each setting's own range (`mop.config.check_fields`), the launch (ranks against GPUs, the
   reference strategy's one process), the layout (`mop.parallel.mesh.Layout`), and each part's
   own cross-field checks in its own module (`checks`);
3. the result is a `ResolvedConfig`: the frozen settings plus the world and node size they were
   resolved for. A run's own settling is `mop.settle.settle`: this, then the layout settings left
   automatic fitted to `train.memory_budget` (`mop.settle.fit`, recorded in the config's `fit`).
Every problem raises `ConfigError` (an impossible layout: `LayoutError`) naming the setting.
"""

from __future__ import annotations

import dataclasses
import math

from mop import evaluation, metrics
from mop.config import Config, ConfigError, check_fields
from mop.objectives import OBJECTIVES
from mop.optim import optimizer, schedule
from mop.parallel import baseline, checkpointing, llep, ulysses, vocab
from mop.parallel.mesh import Layout
from mop.runtime import check_ranks_fit_gpus, visible_gpus
from mop.settle import adapters
from mop.settle.resolved import ResolvedConfig

MOST_SEQUENCES_PER_MICRO_BATCH = 4  # the plain rule's cap on `train.micro_batch`
# A rank's tokens per forward past which more sequences per micro-batch only cost memory: a forward of
# this many tokens already fills a GPU's GEMMs (and on the CPU a larger micro-batch was slower: 16K-token
# rollouts trained 1.46x faster one per micro-batch than four, `mop bench grpo-trl`).
TOKENS_FILLING_A_RANK = 8192


def resolve(config: Config, world: int | None = None, local_world: int | None = None) -> ResolvedConfig:
    """`config` resolved (module docstring) for `world` ranks (None: the ranks mop's launcher starts,
    `parallel.nproc`, all on this node), whose smallest node runs `local_world` (default: all)."""
    config = adapters.decide(config)  # a LoRA run's base gives the model
    for objective in OBJECTIVES.values():
        config = objective.decide(config)
    for key, message in config.model.validate():
        raise ConfigError(f"model.{key}", message)
    decided = _decide(config, world, local_world)
    check_resolved(decided, launched=world is None)
    return decided


def check_resolved(config: ResolvedConfig, launched: bool) -> None:
    """Each decided setting's range, the launch, the layout and each part's cross-field checks
    (`launched`: mop's launcher starts the ranks on this machine)."""
    check_fields(config)
    p = config.parallel
    if launched:  # mop launches the ranks itself, one per GPU
        check_ranks_fit_gpus(p.nproc, config.train.device, "--parallel.nproc")  # 0: one per GPU
    if p.strategy == "reference" and config.world != 1:
        raise ConfigError("parallel.strategy", f"'reference' runs one process but the world size is {config.world}; "
                          "use --parallel.strategy=mop or --parallel.nproc=1")
    Layout(config.world, p.sequence, p.expert, p.vocab)  # raises LayoutError naming the setting
    for check in checks():
        check(config, config.world)


def _decide(config: Config, world: int | None, local_world: int | None) -> ResolvedConfig:
    """Every automatic value (0, "auto") decided by its plain rule; explicit settings kept as given
    (a negative degree stays, and the layout names it)."""
    p, m = config.parallel, config.model
    mop = p.strategy == "mop"
    nproc = p.nproc or (1 if p.strategy == "reference" else visible_gpus(config.train.device) or 2)
    world = world or nproc
    node = math.gcd(world, local_world or world)
    heads = m.heads

    def largest(fits) -> int:
        return max(n for n in range(1, node + 1) if node % n == 0 and fits(n)) if mop else 1

    parallel = dataclasses.replace(
        p, nproc=nproc,
        sequence=p.sequence or largest(lambda n: heads % n == 0 and config.data.seq_len % n == 0
                                       and (heads // n) % max(p.attention_head_chunks, 1) == 0),
        expert=p.expert or largest(lambda n: m.experts % n == 0),
        vocab=p.vocab or largest(lambda n: not m.tie_embeddings),
        expert_balance=p.expert_balance if p.expert_balance != "auto" else ("llep" if mop else "ep"))
    offload = config.optim.offload
    if offload == "auto":
        offload = mop and (config.adapters is None or adapters.adapters_on_host(
            dataclasses.replace(config, parallel=parallel), world))
    optim = dataclasses.replace(config.optim, offload=offload)
    parallel = dataclasses.replace(parallel, llep_chunks=p.llep_chunks or 1,
                                   attention_head_chunks=p.attention_head_chunks or 1,
                                   vocab_logits="keep" if p.vocab_logits == "auto" else p.vocab_logits)
    t = config.train
    groups = max(world // max(parallel.sequence, 1), 1)
    train = dataclasses.replace(
        t, micro_batch=t.micro_batch or plain_micro_batch(t.global_batch // groups if t.global_batch % groups == 0
                                                          else t.global_batch,
                                                          config.data.seq_len // max(parallel.sequence, 1)),
        activation_checkpointing=(("full" if t.offload_activations is True else "none")  # offload needs it
                                  if t.activation_checkpointing == "auto" else t.activation_checkpointing),
        offload_activations=False if t.offload_activations == "auto" else t.offload_activations,
        keep_freed_host_memory=t.keep_freed_host_memory is not False)  # "auto": on
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    return ResolvedConfig(**{**sections, "parallel": parallel, "optim": optim, "train": train}, world=world,
                          local_world=node)


def plain_micro_batch(sequences_per_group: int, rank_tokens_per_sequence: int,
                      cap: int = MOST_SEQUENCES_PER_MICRO_BATCH) -> int:
    """The largest divisor of a data group's sequences per step up to `cap`, and up to as many as keep
    a rank's tokens per forward within `TOKENS_FILLING_A_RANK` (one at least)."""
    cap = max(1, min(cap, TOKENS_FILLING_A_RANK // max(rank_tokens_per_sequence, 1)))
    return max((b for b in range(1, cap + 1) if sequences_per_group % b == 0), default=1)


def checks() -> tuple:
    """Each part's own cross-field checks, `check(config, world)`, in this order."""
    parts = (checkpointing, vocab, llep, ulysses, baseline, optimizer, schedule)
    return (*(part.check_settings for part in parts), check_batch, check_mtp, evaluation.check_settings,
            metrics.check_settings, adapters.check_settings,
            *(objective.check_settings for objective in OBJECTIVES.values()))


def check_mtp(config: Config, world: int) -> None:
    """Training multi-token-prediction depths (`mop.models.mtp`): next-token prediction's objective,
    full fine-tuning, and a sequence group's slices at least as long as the depth (the lookahead reads
    the next slice's first tokens)."""
    depth = config.model.trained_mtp_layers
    if not depth:
        return
    if config.data.format not in ("text", "chat"):
        raise ConfigError("model.mtp_loss_coef", f"trains the MTP depths with next-token prediction (data.format "
                          f"text or chat), not {config.data.format!r}; set it to 0 for this run")
    if config.adapters is not None:
        raise ConfigError("model.mtp_loss_coef", "trains the MTP depths' whole weights, which a LoRA run freezes; "
                          "set it to 0 (the base's MTP layers pass through mop convert merge)")
    if config.data.seq_len // config.parallel.sequence < depth:
        raise ConfigError("parallel.sequence", f"{config.parallel.sequence} leaves slices shorter than "
                          f"model.mtp_layers={depth} tokens; use fewer ranks per sequence or longer sequences")


def check_batch(config: Config, world: int) -> None:
    """A step's sequences split evenly over the data groups, then into micro-batches
    (`TrainingRun.rank_batches`)."""
    t, groups = config.train, config.data_groups(world)
    if t.global_batch % (groups * t.micro_batch):
        raise ConfigError("train.global_batch", f"{t.global_batch} must be a multiple of data groups ({groups}) x "
                          f"train.micro_batch ({t.micro_batch}); e.g. {groups * t.micro_batch}")
