"""One place builds a training run: data, model shards, parallelisation, optimizer, gradient feed,
data slicing and memory accounting. `mop train` runs what `build_run` returns, `mop bench e2e`
measures it and the tests train it; nothing else wires these pieces.

Order of `build_run`:
1. the data (tokenizer, packed stream, the held-out sequences of `mop.evaluation`), and the
   check that the model's vocabulary holds the tokenizer's ids;
2. the model, constructed on the meta device in its storage dtype (`Config.storage_dtype`) and
   parallelised there by the strategy (`mop`: `parallelize`; `fsdp2`: `parallelize_fsdp2`;
   `reference`: the memory options only), then materialised: each rank allocates and
   initialises only its own shards (`mop.parallel.materialize`), so no rank ever holds the full
   model, and every layout starts from the same weights;
3. the optimizer (`mop.optim.optimizer`): torch AdamW on the device or, with `optim.offload`,
   the host optimizer (its fp32 masters written from the same initial values) fed each gradient
   during the backward;
4. the global views that checkpoints save and load through.

One step of the run (`mop.train`): every rank reads the step's global batch order, keeps its data
group's sequences and its slice of each (`rank_batches`); per micro-batch the model's forward runs
on those tokens with the techniques at its seams (`mop.models`, `mop.parallel`), the backward
reduces each gradient shard and hands it to the optimizer; then the optimizer's `step` takes the
global norm, clips and updates, and the techniques' metrics are collected (`mop.metrics`).

Device state per parameter on each rank (its shard; `state_bytes` reports it):

| train.dtype | optimizer     | weights              | gradients                       | optimizer state     |
|-------------|---------------|----------------------|---------------------------------|---------------------|
| float32     | torch AdamW   | fp32                 | fp32, until the update          | fp32 moments        |
| float32     | host          | fp32                 | released at hand-over           | on the host         |
| bfloat16    | torch AdamW   | fp32 (bf16 autocast) | fp32, until the update          | fp32 moments        |
| bfloat16    | host          | bf16 working copy    | released at hand-over           | on the host         |

With the host optimizer the host holds the fp32 master and moments (plus rollback copies), and
a gradient lives on the device only from its reduce-scatter (in fp32, FSDP2's reduce dtype, the
shard then in the weight's dtype) to its copy to the host, where micro-batches accumulate in
fp32. torch AdamW needs fp32 master weights and moments beside it on the device. Under the
fsdp2 baseline's CPU offload, weights, gradients and moments are FSDP2's host shards.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mop.adapters import base_identity
from mop.checkpoint import read_buffers
from mop.config import Config, ConfigError
from mop.data import (
    RolloutSettings,
    RouteShape,
    build_data,
    group_slice,
    load_batch,
    micro_batches,
    sequence_shard,
    source_options,
)
from mop.evaluation import HeldOut, held_out
from mop.flops import Peak
from mop.models.config import ModelConfig
from mop.models.families import model_spec
from mop.models.hf import HFWeights, source_record
from mop.models.lora import LoraConfig, is_adapter, stored_rows, stored_tensors
from mop.models.spec import ModelSpec
from mop.models.transformer import MoETransformer
from mop.optim.host_adamw import HostAdamW
from mop.optim.optimizer import DeviceAdamW, HostOptimizer, Optimizer, parameter_groups
from mop.parallel.baseline import parallelize_fsdp2
from mop.parallel.checkpointing import canonical_name
from mop.parallel.materialize import (
    RowSource,
    initial_values,
    materialize,
    write_weights,
)
from mop.parallel.parallelize import apply_memory_options, parallelize
from mop.parallel.placement import placements
from mop.parallel.views import GlobalViews
from mop.runtime import Runtime


def build_optimizer(model: torch.nn.Module, config: Config, runtime: Runtime) -> Optimizer:
    """torch AdamW on the device or, with `optim.offload`, the host optimizer (`mop.optim.optimizer`)."""
    o = config.optim
    groups = parameter_groups(model, o.weight_decay)
    record = placements(config.model, runtime.world, config.parallel.expert, config.parallel.vocab, config.adapters)
    copies = {id(p): record[canonical_name(name)].replicas for name, p in model.named_parameters()}
    replicas = {key: count for key, count in copies.items() if count > 1}  # a global norm counts them once
    if o.offload:
        host = HostAdamW(groups, betas=(o.beta1, o.beta2), eps=o.eps, speculative=o.speculative, replicas=replicas)
        return HostOptimizer(host, model, runtime.world_group, runtime.device)
    adamw = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return DeviceAdamW(adamw, model, runtime.world_group, runtime.device, replicas)


def build_model_shards(config: Config, runtime: Runtime, initialise: bool = True,
                       base: HFWeights | None = None) -> tuple[MoETransformer, GlobalViews]:
    """This rank's parallelised model, its own shards allocated and (unless `initialise` is False,
    see `materialize`) initialised, a LoRA run's base read from `base` (module docstring, step 2)."""
    with torch.device("meta"):
        model = MoETransformer(config.model, config.adapters).cast_parameters(config.storage_dtype,
                                                                               config.compute_dtype)
    strategy = config.parallel.strategy
    if strategy == "mop":
        model = parallelize(model, runtime.layout, config)
    elif strategy == "fsdp2":
        model = parallelize_fsdp2(model, runtime.layout, config)
    else:
        apply_memory_options(model, config, runtime.device)
    views = materialize(model, runtime.layout, runtime.device, starting_rows(config, base) if initialise else None)
    return model, views


def starting_rows(config: Config, base: HFWeights | None = None) -> RowSource:
    """The rows the run's parameters start from: their initial values (`initial_values`), but for a
    LoRA base read from a Hugging Face directory (`base`: only the adapters start from initial
    values); a frozen weight kept in a published format as `base` publishes it, or quantized
    (`stored_rows`)."""
    initial = initial_values(config.train.seed, config.model.init_std)
    stored = _stored_tensors(config.model, config.adapters)
    if base is None:
        return stored_rows(initial, stored)

    def rows(name: str, shape, first: int, count: int) -> torch.Tensor:
        return (initial if is_adapter(name) else base.rows)(name, shape, first, count)

    return stored_rows(rows, stored, base.stored_rows)


def base_weights(config: Config):
    """A LoRA run's base (`lora.base`) opened for reading, as a context; None without one."""
    lora = config.adapters
    return HFWeights(lora.base) if lora is not None and lora.base else nullcontext()


@functools.lru_cache(maxsize=8)
def _stored_tensors(model: ModelConfig, lora: LoraConfig | None) -> dict:
    """`stored_tensors` of the model built on the meta device (the parallelised one wraps its modules)."""
    with torch.device("meta"):
        return stored_tensors(MoETransformer(model, lora))


@dataclass
class TrainingRun:
    """Everything one rank trains with; `build_run` makes it."""

    config: Config
    runtime: Runtime
    model: MoETransformer
    views: GlobalViews
    optimizer: Optimizer
    data: object  # mop.data.Data, or the RL loop's mop.rl.feed.RolloutFeed
    held_out: HeldOut | None  # the sequences evaluations read (`mop.evaluation`), None without evaluation
    base: dict | None = None  # a LoRA run's base (`mop.adapters.base_identity`), None for full fine-tuning
    expert_counts: torch.Tensor | None = None
    """The last step's global expert counts `[moe_blocks, E]` (float64, on the host; `mop.train.train_step`;
    the MTP depths' blocks after the model's):
    what the records' expert load is built from."""
    mtp: dict | None = None
    """Where the model's multi-token-prediction layers are kept, frozen (`mop.checkpoint.save_hf_import`'s
    record: a Hugging Face directory, its fingerprint, the layer count), from the checkpoint it started
    from; recorded in every checkpoint so that `mop convert to-hf` passes them through. None: none."""
    hf_source: dict | None = None
    """The Hugging Face checkpoint its weights came from (`mop.models.hf.source_record`): a LoRA run's base,
    else the record of the checkpoint it started from (an import's, carried by every checkpoint of a run
    from it); what its exports keep of config.json and are written as when published. None: none."""
    peak: Peak | None = None
    """What its MFU divides by (`mop.flops.Peak`), measured before its first step (`mop.train.run_step`)."""
    reference: dict | None = None
    """What its objective prepared before step 0 (`Objective.prepare`: what a DPO run's precomputed
    reference log-probs are of), recorded in every checkpoint; None: nothing."""

    @property
    def spec(self) -> ModelSpec:
        """The model's shape facts (FLOPs per token, parameter counts)."""
        return model_spec(self.config.model)

    @property
    def offload_store(self):
        """The activation offload's host store (None without `train.offload_activations`)."""
        return getattr(self.model, "activation_offload", None)

    def autocast(self):
        dtype = self.config.compute_dtype
        return torch.autocast(self.runtime.device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    def close(self) -> None:
        """End the run's worker threads (the host optimizer's, the RL loop's sampling); the run is not used
        after."""
        self.optimizer.close()
        self.data.close()

    def micro_batches_per_step(self) -> int:
        return self.config.micro_batches_per_step(self.runtime.world)

    def next_batches(self) -> list[dict]:
        """This rank's micro-batches of the next step: its data group's sequences, its slice of each.

        Every rank advances the data stream by the same global batch, so the stream's position is
        the checkpointed data position.
        """
        indices = self.data.stream.next_batch(self.config.train.global_batch)  # the RL loop draws its batch here
        return self.rank_batches(indices, self.data.dataset)

    def last_batches(self) -> list[dict]:
        """This rank's micro-batches of the global batch the data stream served last (a resume inside
        a batch trained for several steps serves it again)."""
        size = self.config.train.global_batch
        indices = self.data.stream.indices(self.data.stream.position - size, size)  # the RL loop reads its file
        return self.rank_batches(indices, self.data.dataset)

    def rank_batches(self, indices: list[int], dataset) -> list[dict]:
        """This rank's micro-batches of the sequences `indices` of `dataset` (`rank_indices`), its slice
        of each sequence."""
        d = self.config.parallel.sequence
        return [sequence_shard(load_batch(dataset, part), self.runtime.rank % d, d)
                for part in self.rank_indices(indices)]

    def rank_indices(self, indices: list) -> list[list]:
        """The entries of `indices` in this rank's micro-batches: its data group's contiguous share, in
        micro-batches of `train.micro_batch`."""
        d, runtime = self.config.parallel.sequence, self.runtime
        return micro_batches(group_slice(indices, runtime.rank // d, runtime.world // d), self.config.train.micro_batch)

    def state_bytes(self) -> dict:
        """This rank's persistent training state by category and place, in bytes, and the device
        bytes per parameter (see the module docstring's table); constant over a run."""
        params = [(p.to_local() if hasattr(p, "to_local") else p, p.requires_grad)
                  for p in self.model.parameters()]
        count = max(1, sum(p.numel() for p, _ in params))
        weights = sum(p.nbytes for p, _ in params)
        offloaded, optimizer_bytes = self.optimizer.on_host, self.optimizer.state_bytes()
        host_optimizer = optimizer_bytes if offloaded else 0
        on_host = self.config.parallel.fsdp_cpu_offload  # the fsdp2 baseline's CPU offload
        # torch AdamW's gradients live until the update, in the parameter's dtype; the host
        # optimizer's are released at hand-over. A frozen base (LoRA) has none.
        gradients = 0 if offloaded else sum(p.nbytes for p, trains in params if trains)
        moments = 0 if offloaded else optimizer_bytes
        device = {"weights": 0 if on_host else weights, "gradients": 0 if on_host else gradients,
                  "optimizer": 0 if on_host else moments}
        host = {"weights": weights if on_host else 0, "gradients": gradients if on_host else 0,
                "optimizer": host_optimizer + (moments if on_host else 0)}
        return {"mem_param_shards_bytes": weights, "mem_grad_shards_bytes": gradients,
                "mem_optimizer_state_bytes": optimizer_bytes, "mem_optimizer_on_host": offloaded,
                **{f"device_{k}_bytes": v for k, v in device.items()}, **{f"host_{k}_bytes": v for k, v in host.items()},
                **{f"device_bytes_per_param_{k}": v / count for k, v in device.items()}}


def rollout_settings(config: Config, sequences: int = 0) -> RolloutSettings | None:
    """What recorded rollouts are checked against (the model's routing shape) and scaled by, and the
    sequences they are padded to (`RolloutSettings.sequences`); None: the run trains on other data."""
    if config.data.format != "rollouts":
        return None
    m = config.model
    return RolloutSettings(RouteShape(m.layers, m.dense_layers, m.experts, m.top_k), config.rl.scale_rewards,
                           sequences)


def build_run(config: Config, runtime: Runtime, data=None) -> TrainingRun:
    """Data, model shards, optimizer and gradient feed of one rank (see the module docstring); `data`:
    the run's data when it is not read from data.source (the RL loop's `mop.rl.feed.RolloutFeed`)."""
    d = config.data
    if data is None:
        data = build_data(d.source, d.tokenizer, d.seq_len, config.train.seed, eos_token=d.eos_token or None,
                          **source_options(d, rollout_settings(config)))
    data, evaluation = held_out(config, data)
    if data.tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the tokenizer's "
                          f"{data.tokenizer.vocab_size} ids; set --model.vocab_size={data.tokenizer.vocab_size} or more")
    # bf16 working weights with fp32 host masters: the masters take the fp32 initial values and the
    # weights their rounding, one draw of each value.
    masters_first = config.optim.offload and config.storage_dtype != torch.float32
    with base_weights(config) as base:
        model, views = build_model_shards(config, runtime, initialise=not masters_first, base=base)
        optimizer = build_optimizer(model, config, runtime)
        if masters_first:
            write_weights(model, views, starting_rows(config, base), optimizer)
        if base is not None:
            read_buffers(model, base)
        source = source_record(base) if base is not None else None
    return TrainingRun(config, runtime, model, views, optimizer, data, evaluation, base_identity(config),
                       hf_source=source)
