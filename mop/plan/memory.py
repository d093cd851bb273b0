"""Per-rank device memory and per-node host memory of one training step, from the config alone.

The model is the trainer's own rules, read from the same code, not a separate spreadsheet:
- parameter shapes and who holds which rows: the run's placement record (`mop.parallel.placement`,
  from the `MoETransformer` built on the meta device): FSDP2's dim-0 sharding (a rank holds
  `ceil(rows / ranks)` rows of a sharded tensor: FSDP2 pads dim 0 to a multiple of the ranks),
  expert partitions of E/Ep experts sharded over their W/Ep replicas, the vocabulary shard
  `ceil(V/P)` rows kept out of FSDP2;
- dtypes: `mop.build.storage_dtype` for the stored weights, the compute dtype for gathered
  weights and activations (FSDP2's `param_dtype`), fp32 for gradients as FSDP2 reduces them;
- the activations each option keeps (`mop.plan.activations`);
- LoRA (`train.finetune = "lora"`, `AdapterCounts`): the adapted model as `mop.build` makes it,
  each parameter in its own dtype (the frozen base as stored: fp8 with its scales, MXFP4, or the
  compute dtype; the adapters in the stored dtype); FSDP2 gathers them as stored, a GEMM
  dequantizes one frozen weight to the compute dtype, a frozen matmul saves no input (the MoE
  layer's normed input is then saved by none), and gradients, optimizer state and host memory
  exist for the adapters alone. Not modelled: the adapters' own `[tokens, r]` intermediates
  (r / hidden of the inputs they share with the frozen GEMM) and dropout's masks (default off).

Moments. A step's device peak is the persistent state plus the largest of four moments (only one
micro-batch's activations live at a time):
1. forward, the last block's expert GEMMs: every earlier block's saved activations (or, under
   checkpointing, their inputs), this block's attention and router activations, the routed rows,
   the expert intermediate, and the weights FSDP2 has gathered;
2. the loss: every block's saved activations, the final norm's, and the loss's own working set
   (one `[token_block, V/P]` logit tile and the travelling shards and gradient buffers under the
   ring; the full `[T, V]` logits, their log-softmax and its gradient without it);
3. backward, the last block's experts: the saved activations (recomputed for this block under
   checkpointing) plus the expert backward's gradients and the unsharded gradients of the running
   units;
4. the update, with torch AdamW on the device: every gradient shard beside the weights and the
   moments, and the foreach kernel's temporaries (about one fp32 copy of the shards).
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

from mop.build import step_micro_batches, storage_dtype
from mop.config import Config
from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig, stored_tensors
from mop.models.transformer import MoETransformer
from mop.parallel.parallelize import compute_dtype
from mop.parallel.placement import placements
from mop.plan.activations import (
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
    router_saved,
    rows,
    shapes,
)


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
                           storage_dtype(config), compute_dtype(config))


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
    m, p, t = config.model, config.parallel, config.train
    s = shapes(config, routing_skew, tp)
    counts = parameter_counts(m, world, p.expert, p.vocab, tp)
    stored = storage_dtype(config).itemsize
    host_optimizer, fsdp_offload = config.optim.offload, p.fsdp_cpu_offload
    lora = adapter_counts(config, world, tp) if config.adapters is not None else None
    trained = counts.local if lora is None else lora.trained
    # Persistent: the shards (on the host under FSDP2's CPU offload), torch AdamW's moments, and
    # its gradients once a micro-batch has made them (the host optimizer takes each at hand-over).
    base = rows()
    if not fsdp_offload:
        shards = ({"dense": counts.dense * stored, "experts": counts.experts * stored, "vocab": counts.vocab * stored}
                  if lora is None else lora.bytes_by_category)
        base["dense_weights"], base["expert_weights"], base["vocab_weights"] = (
            shards["dense"], shards["experts"], shards["vocab"])
        if not host_optimizer:
            base["optimizer_state"] = 2 * trained * FP32
            if step_micro_batches(config, world) > 1:
                base["gradients"] = trained * stored
    # Gathered by FSDP2 while the model runs: the root unit (embedding, final norm, and the output
    # projection without vocabulary parallelism), which FSDP2 keeps unsharded from its forward to
    # its backward, all step long; inside a block, its unit and the one prefetched, and the
    # running layer's expert partition (plus one expert LLEP ships in); in the compute dtype, or as
    # stored under LoRA, whose GEMMs dequantize one frozen weight at a time.
    base["dense_weights"] += m.vocab_size * m.hidden * (1 if p.vocab > 1 or m.tie_embeddings else 2) // tp * s.act
    in_block = rows()
    ships = p.expert > 1 and p.expert_balance == "llep"
    local_experts = m.experts // p.expert
    if lora is None:
        shipped = ships * counts.expert_partition // local_experts
        in_block["dense_weights"] = 2 * counts.largest_dense_unit * s.act
        in_block["expert_weights"] = (counts.expert_partition + shipped) * s.act
        running_gradients = counts.expert_partition + counts.largest_dense_unit + shipped
    else:
        in_block["dense_weights"] = 2 * lora.unit_bytes
        in_block["expert_weights"] = lora.partition_bytes + ships * lora.partition_bytes // local_experts
        running_gradients = lora.partition_trained + lora.unit_trained + ships * lora.partition_trained // local_experts

    checkpointed = t.activation_checkpointing == "full"
    moe_block = block_saved(s, config, moe=True)
    dense_block = block_saved(s, config, moe=False)
    kept = rows() if t.offload_activations else block_kept(s, config)  # on the device

    def blocks(count_moe: int, count_dense: int) -> dict[str, int]:
        out = rows()
        if checkpointed:
            add(out, kept, count_moe + count_dense)
        else:
            add(out, moe_block, count_moe)
            add(out, dense_block, count_dense)
        return out

    moe_layers, dense_layers = m.moe_layers, m.dense_layers
    last_is_moe = moe_layers > 0
    # 1. forward, the last block's experts
    forward = Moment("forward: last block's expert GEMMs", dict(base))
    add(forward.rows, in_block)
    add(forward.rows, blocks(moe_layers - last_is_moe, dense_layers - (not last_is_moe)))
    current = dict(moe_block if last_is_moe else dense_block)
    if checkpointed:  # only what the block's code still holds: nothing is saved inside a checkpoint
        current = rows()
        current["residual_and_norms"] = 3 * s.T * s.H * s.act
        current["moe_activations"] = router_saved(s)
    else:
        current["moe_activations"] -= experts_saved(s, p.llep_chunks) if last_is_moe else 0
    add(forward.rows, current)
    if last_is_moe:
        forward.rows["moe_activations"] += experts_forward_peak(s, p.llep_chunks)
    dequantized = _dequantized(lora, last_is_moe, s)
    add(forward.rows, dequantized)
    # 2. the loss
    loss = Moment("loss: the vocabulary projection's backward", dict(base))
    add(loss.rows, blocks(moe_layers, dense_layers))
    loss.rows["residual_and_norms"] += s.T * s.H * s.act + norm(s, s.H)
    add(loss.rows, loss_working_set(s, config))
    # 3. backward, the last block's experts: their saved tensors (recomputed under checkpointing),
    # the gradients flowing through them, and the unsharded gradients of the gathered units
    backward = Moment("backward: last block's experts", dict(base))
    add(backward.rows, in_block)
    add(backward.rows, blocks(moe_layers, dense_layers))
    if checkpointed:  # the block recomputed from its kept input (back from the host with offload)
        add(backward.rows, moe_block if last_is_moe else dense_block)
        backward.rows["residual_and_norms"] -= s.T * s.H * s.act  # the input is the kept one
        if t.offload_activations:
            add(backward.rows, block_kept(s, config))
    if last_is_moe:
        # autograd runs the later-created shared expert's backward first: its tensors are gone
        backward.rows["moe_activations"] += experts_backward_peak(s, p.llep_chunks) - mlp_saved(s, s.shared)
        # the unsharded gradients of the running units, and of the expert LLEP shipped in
        backward.rows["gradients"] += running_gradients * FP32
    add(backward.rows, dequantized)  # the backward's GEMMs dequantize their weights again
    moments = [forward, loss, backward]
    if not host_optimizer and not fsdp_offload:  # 4. torch AdamW steps on the device
        update = Moment("update: torch AdamW on the device", dict(base))
        update.rows["gradients"] = trained * stored + trained * FP32
        moments.append(update)
    return MemoryEstimate(max(moments, key=lambda x: x.total), moments, host_bytes(config, trained, s), ranks_per_node,
                          s, counts, lora)


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
    stored = storage_dtype(config).itemsize
    if config.optim.offload:
        out["optimizer"] = trained * ((7 if config.optim.speculative else 4) * FP32 + stored)
    if config.parallel.fsdp_cpu_offload:  # never under LoRA (`mop.adapters.check_settings`)
        out["parameters"] = trained * 2 * FP32
        out["optimizer"] = trained * 2 * FP32
    return out


def offloaded_activations(config: Config, s: Shapes) -> int:
    """Bytes `train.offload_activations` moves to the host per micro-batch: every block's kept tensors."""
    if not config.train.offload_activations:
        return 0
    return config.model.layers * sum(block_kept(s, config).values())
