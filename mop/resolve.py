"""Raw settings in, one frozen resolved config out, built once where the world and device are known.

`resolve(config, world, local_world)`:
1. the model's shape is checked (`ModelConfig.validate`), then every automatic setting is
   decided: a LoRA run's model and base format from its base (`mop.adapters.decide`),
   `parallel.nproc` (one rank per visible GPU on CUDA, 2 on the CPU, 1 for the reference
   strategy), the degrees D, Ep and P (under "mop" the largest that fit the model and divide one
   node's ranks, so every group stays on a node's fast links; 1 otherwise),
   `parallel.expert_balance` and `optim.offload` (under "mop" the host optimizer, but for LoRA
   adapters small enough for torch AdamW on the device, `mop.adapters.adapters_on_host`), and
   the memory settings by their plain rules (no head or LLEP chunks, no checkpointing or offload,
   up to 4 sequences per micro-batch);
2. each setting's own range (`mop.config.check_fields`), the launch (ranks against GPUs, the
   reference strategy's one process), the layout (`mop.parallel.mesh.Layout`), and each part's
   own cross-field checks in its own module (`CHECKS`);
3. the result is a `ResolvedConfig`: the frozen settings plus the world and node size they were
   resolved for. A run uses it as it is (`mop.train.setup_runtime` resolves only a raw config)
   and writes it to the run directory as `config.json`. A run's own resolution is
   `mop.plan.fit.fitted`: this, then the layout settings left automatic fitted to
   `train.memory_budget` (recorded in the config's `fit`).
Every problem raises `ConfigError` (an impossible layout: `LayoutError`) naming the setting.
"""

from __future__ import annotations

import dataclasses
import math

from mop import adapters, build, evaluation, metrics
from mop.config import Config, ConfigError, check_fields
from mop.optim import optimizer, schedule
from mop.parallel import baseline, checkpointing, llep, ulysses, vocab
from mop.parallel.mesh import Layout
from mop.preference import settings as preference
from mop.runtime import check_memory_budget, check_ranks_fit_gpus, visible_gpus

MOST_SEQUENCES_PER_MICRO_BATCH = 4  # the plain rule's cap on `train.micro_batch`
# Each part's own cross-field checks, `check_settings(config, world)`, in this order.
CHECKS = (checkpointing, vocab, llep, ulysses, baseline, optimizer, schedule, build, evaluation, metrics, adapters,
          preference)


@dataclasses.dataclass(frozen=True)
class FitRecord:
    """How `mop.plan.fit` fitted a run's automatic settings to its memory budget (the start line and
    config.json)."""

    budget_bytes: int
    budget_source: str
    searched: tuple[str, ...]
    """The settings that were automatic."""
    layout: str
    """The chosen layout in a few words (`mop.plan.candidates.describe`)."""
    kept_default: bool
    """True when the plain layout fits and was kept without a search."""
    predicted_peak_bytes: int
    """The memory model's device peak for one rank."""
    predicted_host_bytes: int
    """Its host bytes for one rank."""
    predicted_need_bytes: int
    """What counts against the budget: the device peak (plus the host bytes on the CPU, one memory)."""
    predicted_moment: str
    predicted_tokens_per_s: float
    """The roofline's tokens/s per rank (nominal on the CPU: for comparing layouts)."""
    considered: int
    binding: str
    """Why nothing faster was chosen (`mop.plan.candidates.binding`)."""


@dataclasses.dataclass(frozen=True)
class ResolvedConfig(Config):
    """Settings with every automatic value decided and every check passed, for `world` ranks."""

    world: int = 0
    """The ranks the settings were resolved for."""
    local_world: int = 0
    """The ranks of the smallest node, which the automatic degrees divide."""
    fit: FitRecord | None = None
    """How the automatic settings were fitted to train.memory_budget (`mop.plan.fit`); None: no fit."""


def resolve(config: Config, world: int | None = None, local_world: int | None = None) -> ResolvedConfig:
    """`config` resolved (module docstring) for `world` ranks (None: the ranks mop's launcher starts,
    `parallel.nproc`, all on this node), whose smallest node runs `local_world` (default: all)."""
    config = preference.decide(adapters.decide(config))  # a LoRA run's base gives the model
    for key, message in config.model.validate():
        raise ConfigError(f"model.{key}", message)
    check_memory_budget(config.train.memory_budget)
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
    for part in CHECKS:
        part.check_settings(config, config.world)


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
                                   attention_head_chunks=p.attention_head_chunks or 1)
    t = config.train
    groups = max(world // max(parallel.sequence, 1), 1)
    train = dataclasses.replace(
        t, micro_batch=t.micro_batch or plain_micro_batch(t.global_batch // groups if t.global_batch % groups == 0
                                                          else t.global_batch),
        activation_checkpointing=(("full" if t.offload_activations is True else "none")  # offload needs it
                                  if t.activation_checkpointing == "auto" else t.activation_checkpointing),
        offload_activations=False if t.offload_activations == "auto" else t.offload_activations)
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    return ResolvedConfig(**{**sections, "parallel": parallel, "optim": optim, "train": train}, world=world,
                          local_world=node)


def plain_micro_batch(sequences_per_group: int, cap: int = MOST_SEQUENCES_PER_MICRO_BATCH) -> int:
    """The largest divisor of a data group's sequences per step up to `cap`."""
    return max((b for b in range(1, cap + 1) if sequences_per_group % b == 0), default=1)
