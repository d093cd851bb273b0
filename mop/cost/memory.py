"""Per-rank device memory and per-node host memory of one training step, from the config alone.

The model is the trainer's own rules, read from the same code, not a separate spreadsheet:
- parameter shapes and who holds which rows: the run's placement record (`mop.parallel.placement`,
  from the `MoETransformer` built on the meta device): FSDP2's dim-0 sharding (a rank holds
  `ceil(rows / ranks)` rows of a sharded tensor: FSDP2 pads dim 0 to a multiple of the ranks),
  expert partitions of E/Ep experts sharded over their W/Ep replicas, the vocabulary shard
  `ceil(V/P)` rows kept out of FSDP2;
- dtypes: `Config.storage_dtype` for the stored weights, the compute dtype for gathered
  weights and activations (FSDP2's `param_dtype`), fp32 for gradients as FSDP2 reduces them;
- the activations each option keeps (`mop.cost.activations`);
- LoRA (`train.finetune = "lora"`, `AdapterCounts`): the adapted model as `mop.build` makes it,
  each parameter in its own dtype (the frozen base as stored: fp8 with its scales, MXFP4, or the
  compute dtype; the adapters in the stored dtype); FSDP2 gathers them as stored, a GEMM
  dequantizes one frozen weight to the compute dtype, a frozen matmul saves no input (the MoE
  layer's normed input is then saved by none), and gradients, optimizer state and host memory
  exist for the adapters alone. Not modelled: the adapters' own `[tokens, r]` intermediates
  (r / hidden of the inputs they share with the frozen GEMM) and dropout's masks (default off).

Moments. A step's device peak is the persistent state (the shards, torch AdamW's state, the
gathered root unit) plus the largest of four moments (only one micro-batch's activations live at
a time), each computed by its own function (which says what it holds):
1. forward, the last block's expert GEMMs (`_forward`): the earlier blocks' saved activations, this
   block's up to its experts and their working set, the weights FSDP2 has gathered;
2. the loss (`_loss`): every block's saved activations and the loss's own working set;
3. backward, the last block's experts (`_backward`): the saved activations, the expert backward's
   gradients and the unsharded gradients of the running units;
4. the update, with torch AdamW on the device (`_update`): every gradient shard and the foreach
   kernel's temporaries.
Each moment is reported by the paper's Table 3 rows (`ROWS`), which sum to its total.

Not modelled: allocator fragmentation and caching (the prediction is what
`torch.cuda.max_memory_allocated` counts, not what `nvidia-smi` shows), NCCL's own buffers, the
CUDA context (about 0.5-1 GiB per GPU; `Cluster.reserve_bytes` leaves room for them), the tiny
integer routing tables.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from mop.config import Config
from mop.cost.activations import (
    FP32,
    Shapes,
    add,
    block_kept,
    block_saved,
    experts_backward_peak,
    experts_forward_peak,
    experts_saved,
    loss_working_set,
    mlp_saved,
    norm,
    padded_vocab,
    router_saved,
    rows,
    shapes,
)
from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig, stored_tensors
from mop.models.transformer import MoETransformer
from mop.parallel.placement import placements


@dataclass(frozen=True)
class ParameterCounts:
    """Elements of each kind of parameter this rank holds (its shards), and the full counts."""

    dense: int  # attention, norms, routers, dense MLPs, shared experts, embedding (and the output
    # projection without vocabulary parallelism)
    experts: int  # routed experts
    vocab: int  # the output projection's row shard (vocabulary parallelism only)
    total: int  # the whole model
    expert_partition: int  # one MoE layer's gathered expert partition (E/Ep experts)
    largest_dense_unit: int  # the largest block's gathered dense weights (its FSDP2 unit, experts apart)

    @property
    def local(self) -> int:
        return self.dense + self.experts + self.vocab


def parameter_counts(model: ModelConfig, world: int, expert: int, vocab: int, tp: int = 1) -> ParameterCounts:
    return _parameter_counts(model, world, expert, vocab, tp)


@functools.lru_cache(maxsize=4096)
def _parameter_counts(model: ModelConfig, world: int, expert: int, vocab: int, tp: int) -> ParameterCounts:
    """Every parameter's shard as the run places it (`mop.parallel.placement`). `tp` > 1: the
    planner's tensor-parallel baseline, which splits every matrix over tp ranks and FSDP-shards
    over the world / tp."""
    dense = experts = head = total = 0
    units: dict[str, int] = {}
    for name, place in placements(model, world // tp, expert, vocab).items():
        numel = math.prod(place.shape)
        split = tp if len(place.shape) > 1 else 1
        local = place.local_rows * place.row_elements // split
        total += numel
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        if place.category == "expert":  # the gathered unit is one partition (E/Ep experts)
            gathered = f"{unit}.experts"
            units[gathered] = units.get(gathered, 0) + place.shape[0] // place.partitions * place.row_elements // split
            experts += local
        elif not place.fsdp_group:  # the vocabulary ring's row shard, never gathered
            head += local
        else:
            units[unit] = units.get(unit, 0) + numel // split
            dense += local
    blocks = [v for k, v in units.items() if not k.endswith("experts") and k != "root"]
    partitions = [v for k, v in units.items() if k.endswith(".experts")]
    return ParameterCounts(dense, experts, head, total, max(partitions, default=0), max(blocks))


@dataclass(frozen=True)
class AdapterCounts:
    """A LoRA run's shards as it keeps them: the frozen base in its format and dtype (fp8 with its
    scales, MXFP4, or the compute dtype), the adapters in the stored dtype; what trains is the
    adapters alone, and a GEMM dequantizes one frozen weight at a time."""

    bytes_by_category: dict[str, int]  # this rank's shards: "dense", "experts", "vocab" (as `ParameterCounts`)
    trained: int  # this rank's adapter elements
    unit_bytes: int  # the largest block's dense unit, gathered as stored
    partition_bytes: int  # one MoE layer's expert partition, gathered as stored
    unit_trained: int  # adapter elements of that unit (their unsharded gradients in the backward)
    partition_trained: int
    dense_gathered: int  # every dense unit (the root's too), gathered as stored (bytes per pass)
    dense_trained: int  # adapter elements of those units (their gradients are reduce-scattered)
    dequantized_dense: int  # elements of the largest frozen dense weight dequantized for a GEMM
    dequantized_experts: int  # elements of the largest projection of an expert partition, dequantized


def adapter_counts(config: Config, world: int, tp: int = 1) -> AdapterCounts:
    p = config.parallel
    return _adapter_counts(config.model, config.adapters, world // tp, p.expert, p.vocab, tp,
                           config.storage_dtype, config.compute_dtype)


@functools.lru_cache(maxsize=256)
def _adapter_counts(model: ModelConfig, lora: LoraConfig, world: int, expert: int, vocab: int, tp: int,
                    stored: torch.dtype, compute: torch.dtype) -> AdapterCounts:
    dtypes, trains, weights = _adapted_parameters(model, lora, stored, compute)
    by_category, units, unit_trained = dict.fromkeys(("dense", "experts", "vocab"), 0), {}, {}
    trained = 0
    for name, place in placements(model, world, expert, vocab, lora).items():
        split = tp if len(place.shape) > 1 else 1
        local = place.local_rows * place.row_elements // split
        trained += local * trains[name]
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        category = "experts" if place.category == "expert" else "dense" if place.fsdp_group else "vocab"
        by_category[category] += local * dtypes[name]
        if category == "experts":
            unit += ".experts"
        elif category == "vocab":  # the vocabulary ring's row shard, never gathered
            continue
        gathered = math.prod(place.shape) // place.partitions // split
        units[unit] = units.get(unit, 0) + gathered * dtypes[name]
        unit_trained[unit] = unit_trained.get(unit, 0) + gathered * trains[name]
    blocks = [k for k in units if k != "root" and not k.endswith(".experts")]
    partitions = [k for k in units if k.endswith(".experts")]
    unit = max(blocks, key=units.get)
    partition = max(partitions, key=units.get, default=None)
    dense = [n for w, n in weights.items() if ".experts." not in w]
    experts = [n // expert for w, n in weights.items() if ".experts." in w]
    return AdapterCounts(
        by_category, trained, units[unit], units.get(partition, 0), unit_trained[unit], unit_trained.get(partition, 0),
        sum(units[k] for k in units if k not in partitions), sum(unit_trained[k] for k in units if k not in partitions),
        max(dense, default=0) // tp, max(experts, default=0) // tp)


@functools.lru_cache(maxsize=16)
def _adapted_parameters(model: ModelConfig, lora: LoraConfig, stored: torch.dtype, compute: torch.dtype):
    """Of the adapted model as `mop.build` makes it: each parameter's bytes per element and whether
    it trains, and each weight kept in a format with its elements (what a GEMM dequantizes)."""
    with torch.device("meta"):
        meta = MoETransformer(model, lora).cast_parameters(stored, compute)
    params = dict(meta.named_parameters())
    weights = {entry.weight: math.prod(entry.shape) for entry in stored_tensors(meta).values()}
    return ({n: p.element_size() for n, p in params.items()}, {n: int(p.requires_grad) for n, p in params.items()},
            weights)


def dequantization_bytes(elements: int, act: int) -> int:
    """A weight dequantized for its GEMM (`mop.models.formats`), in the compute dtype. The fp32
    temporaries of one slab are gone before the GEMM allocates its output, a wider working set."""
    return elements * act


@dataclass
class Moment:
    """Bytes by row at one moment of the step."""

    name: str
    rows: dict[str, int] = field(default_factory=rows)

    @property
    def total(self) -> int:
        return sum(self.rows.values())


@dataclass
class MemoryEstimate:
    """A rank's predicted device bytes (at its peak moment, by row) and a node's host bytes."""

    peak: Moment
    moments: list[Moment]
    host_bytes_per_rank: dict[str, int]
    ranks_per_node: int
    shapes: Shapes  # what it was computed from, for the step time
    counts: ParameterCounts
    adapters: AdapterCounts | None  # a LoRA run's

    @property
    def peak_device_bytes(self) -> int:
        return self.peak.total

    @property
    def host_bytes_per_node(self) -> int:
        return self.ranks_per_node * sum(self.host_bytes_per_rank.values())


def estimate(config: Config, world: int, ranks_per_node: int, routing_skew: float = 1.0,
             tp: int = 1) -> MemoryEstimate:
    """The device peak of one rank and the host memory of one node for the resolved `config` on
    `world` ranks (see the module docstring); `tp` > 1 only for the planner's TP baseline."""
    p = config.parallel
    s = shapes(config, routing_skew, tp)
    counts = parameter_counts(config.model, world, p.expert, p.vocab, tp)
    lora = adapter_counts(config, world, tp) if config.adapters is not None else None
    trained = counts.local if lora is None else lora.trained
    persistent = _shards_and_optimizer_state(config, world, counts, lora, trained)
    persistent["dense_weights"] += _gathered_root(config, s, tp)
    moments = [_forward(config, s, counts, lora, persistent), _loss(config, s, persistent),
               _backward(config, s, counts, lora, persistent)]
    if _torch_adamw_on_device(config):
        moments.append(_update(config, persistent, trained))
    return MemoryEstimate(max(moments, key=lambda x: x.total), moments, host_bytes(config, trained, s), ranks_per_node,
                          s, counts, lora)


def _torch_adamw_on_device(config: Config) -> bool:
    """Whether torch AdamW steps on the device: neither the host optimizer nor FSDP2's CPU offload."""
    return not config.optim.offload and not config.parallel.fsdp_cpu_offload


def _shards_and_optimizer_state(config: Config, world: int, counts: ParameterCounts, lora: AdapterCounts | None,
                                trained: int) -> dict[str, int]:
    """Persistent: the shards (on the host under FSDP2's CPU offload), torch AdamW's moments, and
    its gradients once a micro-batch has made them (the host optimizer takes each at hand-over)."""
    out = rows()
    stored = config.storage_dtype.itemsize
    if not config.parallel.fsdp_cpu_offload:
        shards = ({"dense": counts.dense * stored, "experts": counts.experts * stored, "vocab": counts.vocab * stored}
                  if lora is None else lora.bytes_by_category)
        out["dense_weights"], out["expert_weights"], out["vocab_weights"] = (
            shards["dense"], shards["experts"], shards["vocab"])
    if _torch_adamw_on_device(config):
        out["optimizer_state"] = 2 * trained * FP32
        if config.micro_batches_per_step(world) > 1:
            out["gradients"] = trained * stored
    return out


def _gathered_root(config: Config, s: Shapes, tp: int) -> int:
    """The root unit FSDP2 gathers (embedding, final norm, and the output projection without
    vocabulary parallelism) and keeps unsharded from its forward to its backward, all step long."""
    m = config.model
    return m.vocab_size * m.hidden * (1 if config.parallel.vocab > 1 or m.tie_embeddings else 2) // tp * s.act


def _gathered_in_block(config: Config, s: Shapes, counts: ParameterCounts,
                       lora: AdapterCounts | None) -> dict[str, int]:
    """Gathered by FSDP2 inside a block: its unit and the one prefetched, and the running layer's
    expert partition (plus one expert LLEP ships in); in the compute dtype, or as stored under
    LoRA, whose GEMMs dequantize one frozen weight at a time (`_dequantized`)."""
    out = rows()
    if lora is None:
        out["dense_weights"] = 2 * counts.largest_dense_unit * s.act
        out["expert_weights"] = _with_shipped_expert(config, counts.expert_partition) * s.act
    else:
        out["dense_weights"] = 2 * lora.unit_bytes
        out["expert_weights"] = _with_shipped_expert(config, lora.partition_bytes)
    return out


def _running_gradients(config: Config, counts: ParameterCounts, lora: AdapterCounts | None) -> int:
    """The unsharded fp32 gradients of the running units in the backward: the block's dense unit and
    its expert partition (plus the expert LLEP shipped in); under LoRA, of their adapters alone."""
    if lora is None:
        return (_with_shipped_expert(config, counts.expert_partition) + counts.largest_dense_unit) * FP32
    return (_with_shipped_expert(config, lora.partition_trained) + lora.unit_trained) * FP32


def _with_shipped_expert(config: Config, partition: int) -> int:
    """`partition`, one expert partition's bytes or elements, plus under LLEP the one expert it ships
    in (its share of the partition's E/Ep experts)."""
    p = config.parallel
    ships = p.expert > 1 and p.expert_balance == "llep"
    return partition + ships * partition // (config.model.experts // p.expert)


def _saved_between_passes(config: Config, s: Shapes, moe_blocks: int, dense_blocks: int) -> dict[str, int]:
    """What blocks whose forward has run keep on the device for their backward: their saved
    activations, or under full checkpointing what it keeps (nothing here when offloaded to the host)."""
    out = rows()
    t = config.train
    if t.activation_checkpointing == "full":
        if not t.offload_activations:
            add(out, block_kept(s, config), moe_blocks + dense_blocks)
    else:
        add(out, block_saved(s, config, moe=True), moe_blocks)
        add(out, block_saved(s, config, moe=False), dense_blocks)
    return out


def _forward(config: Config, s: Shapes, counts: ParameterCounts, lora: AdapterCounts | None,
             persistent: dict[str, int]) -> Moment:
    """1. Forward, the last block's expert GEMMs: every earlier block's saved activations (or, under
    checkpointing, their inputs), this block's attention and router activations, the routed rows,
    the expert intermediate, and the weights FSDP2 has gathered."""
    m, p = config.model, config.parallel
    moe = m.moe_blocks > 0  # the last block (an MTP depth's, when trained)
    forward = Moment("forward: last block's expert GEMMs", dict(persistent))
    add(forward.rows, _gathered_in_block(config, s, counts, lora))
    add(forward.rows, _saved_between_passes(config, s, m.moe_blocks - moe, m.dense_layers - (not moe)))
    add(forward.rows, _last_block_before_experts(config, s, moe))
    if m.trained_mtp_layers and p.vocab_logits != "recompute":  # the heads before keep their logits
        forward.rows["vocab_tile"] += m.trained_mtp_layers * s.T * padded_vocab(m.vocab_size, p.vocab) * FP32
    if moe:
        forward.rows["moe_activations"] += experts_forward_peak(s, p.llep_chunks)
    add(forward.rows, _dequantized(lora, moe, s))
    return forward


def _last_block_before_experts(config: Config, s: Shapes, moe: bool) -> dict[str, int]:
    """The last block's activations up to its expert GEMMs: its saved ones but the experts'; under
    checkpointing only what the block's code still holds (its input, residual and normed input, and
    the router's tensors): nothing is saved inside a checkpoint."""
    if config.train.activation_checkpointing == "full":
        out = rows()
        out["residual_and_norms"] = 3 * s.T * s.H * s.act
        out["moe_activations"] = router_saved(s)
        return out
    out = block_saved(s, config, moe)
    if moe:
        out["moe_activations"] -= experts_saved(s, config.parallel.llep_chunks)
    return out


def _loss(config: Config, s: Shapes, persistent: dict[str, int]) -> Moment:
    """2. The loss: every block's saved activations, the final norm's, and the loss's own working set
    (`loss_working_set`: one `[token_block, V/P]` logit tile and the travelling shards and gradient
    buffers under the ring; the full `[T, V]` logits, their log-softmax and its gradient without it)."""
    m = config.model
    loss = Moment("loss: the vocabulary projection's backward", dict(persistent))
    add(loss.rows, _saved_between_passes(config, s, m.moe_blocks, m.dense_layers))
    loss.rows["residual_and_norms"] += s.T * s.H * s.act + norm(s, s.H)
    add(loss.rows, loss_working_set(s, config))
    return loss


def _backward(config: Config, s: Shapes, counts: ParameterCounts, lora: AdapterCounts | None,
              persistent: dict[str, int]) -> Moment:
    """3. Backward, the last block's experts: the saved activations (recomputed for this block under
    checkpointing) plus the expert backward's gradients and the unsharded gradients of the running
    units, and the weights FSDP2 has gathered (the GEMMs dequantize theirs again under LoRA)."""
    m, p, t = config.model, config.parallel, config.train
    moe = m.moe_blocks > 0  # the last block
    backward = Moment("backward: last block's experts", dict(persistent))
    add(backward.rows, _gathered_in_block(config, s, counts, lora))
    add(backward.rows, _saved_between_passes(config, s, m.moe_blocks, m.dense_layers))
    if t.activation_checkpointing == "full":  # the block recomputed from its kept input (from the host with offload)
        add(backward.rows, block_saved(s, config, moe))
        backward.rows["residual_and_norms"] -= s.T * s.H * s.act  # the input is the kept one
        if t.offload_activations:
            add(backward.rows, block_kept(s, config))
    if moe:
        # autograd runs the later-created shared expert's backward first: its tensors are gone
        backward.rows["moe_activations"] += experts_backward_peak(s, p.llep_chunks) - mlp_saved(s, s.shared)
        backward.rows["gradients"] += _running_gradients(config, counts, lora)
    add(backward.rows, _dequantized(lora, moe, s))
    return backward


def _update(config: Config, persistent: dict[str, int], trained: int) -> Moment:
    """4. The update, with torch AdamW on the device: every gradient shard beside the weights and the
    moments, and the foreach kernel's temporaries (about one fp32 copy of the shards)."""
    update = Moment("update: torch AdamW on the device", dict(persistent))
    update.rows["gradients"] = trained * config.storage_dtype.itemsize + trained * FP32
    return update


def _dequantized(lora: AdapterCounts | None, experts: bool, s: Shapes) -> dict[str, int]:
    """Under LoRA, the frozen weight the running GEMM has dequantized: the expert partition's
    largest projection during the experts, else the largest dense weight."""
    out = rows()
    if lora is not None:
        elements = lora.dequantized_experts if experts else lora.dequantized_dense
        out["expert_weights" if experts else "dense_weights"] = dequantization_bytes(elements, s.act) if elements else 0
    return out


def host_bytes(config: Config, trained: int, s: Shapes) -> dict[str, int]:
    """Host memory one rank uses on a GPU machine, by kind.

    Host optimizer (`mop.optim.host_adamw`): the fp32 master, the two moments, their rollback
    spares (with `optim.speculative`), the fp32 gradient accumulator and the pinned staging buffer a
    gradient is copied into (in the stored dtype): 28 (16 without the spares) bytes + the stored
    dtype per parameter that trains (the adapters alone under LoRA). FSDP2's CPU offload: the fp32
    shards, their gradients and torch AdamW's moments. Offloaded activations: every block's kept
    tensors (`offloaded_activations`), pinned."""
    out = {"optimizer": 0, "parameters": 0, "activations": offloaded_activations(config, s)}
    stored = config.storage_dtype.itemsize
    if config.optim.offload:
        out["optimizer"] = trained * ((7 if config.optim.speculative else 4) * FP32 + stored)
    if config.parallel.fsdp_cpu_offload:  # never under LoRA (`mop.settle.adapters.check_settings`)
        out["parameters"] = trained * 2 * FP32
        out["optimizer"] = trained * 2 * FP32
    return out


def offloaded_activations(config: Config, s: Shapes) -> int:
    """Bytes `train.offload_activations` moves to the host per micro-batch: every block's kept tensors."""
    if not config.train.offload_activations:
        return 0
    return config.model.blocks * sum(block_kept(s, config).values())
