"""Per-rank device memory and per-node host memory of one training step, from the config alone.

The model is the trainer's own rules, read from the same code, not a separate spreadsheet:
- parameter shapes: the `MoETransformer` built on the meta device (no memory, any size);
- who holds which rows: `mop.parallel.mesh.Layout` groups and FSDP2's dim-0 sharding (a rank holds
  `ceil(rows / ranks)` rows of a sharded tensor: FSDP2 pads dim 0 to a multiple of the ranks);
  expert partitions of E/Ep experts sharded over their W/Ep replicas (`mop.parallel.experts`);
  the vocabulary shard `ceil(V/P)` rows, kept out of FSDP2 (`mop.parallel.vocab`);
- dtypes: `mop.build.storage_dtype` for the stored weights, the compute dtype for gathered
  weights and activations (FSDP2's `param_dtype`), fp32 for gradients as FSDP2 reduces them,
  for router probabilities, RMSNorm internals and logit tiles;
- the logit tile: `mop.parallel.vocab.default_token_block` tokens (or `parallel.vocab_token_block`);
- the options' semantics: what activation checkpointing keeps per block (the input, plus the
  outputs of the chunked parts), what offload moves to the host, what head-chunked attention and
  chunked LLEP save and hold at a time, what the host optimizer leaves on the device.

Phases. A step's device peak is the persistent state plus the largest of three moments of one
micro-batch (only one micro-batch's activations live at a time):
1. forward, the last block's expert GEMMs: every earlier block's saved activations (or, under
   checkpointing, their inputs), this block's attention and router activations, the routed rows,
   the expert intermediate;
2. the loss: every block's saved activations, the final norm's, and the loss's own working set
   (one `[token_block, V/P]` logit tile and the travelling shards and gradient buffers under the
   ring; the full `[T, V]` logits, their log-softmax and its gradient without it);
3. backward, the last block's experts: the saved activations (recomputed for this block under
   checkpointing) plus the expert backward's gradients of the intermediate and of the gathered
   expert partition.
Each moment is reported by the paper's Table 3 rows (`ROWS`), which sum to its total.

Token counts per rank and micro-batch: T = micro_batch x seq_len / D; A = T k routed
assignments; R = ceil(llep_alpha x A) rows computed under LLEP (its capacity: the plan never puts
more on a rank unless a chunk below llep_min_chunk is forced), A x `routing_skew` under plain EP
(the load of the busiest rank relative to the mean, which the data decides; 1.0 = balanced).
Activation checkpointing and chunking are the runtime's (see `mop.parallel.checkpointing`).

Not modelled: allocator fragmentation and caching (the prediction is what
`torch.cuda.max_memory_allocated` counts, not what `nvidia-smi` shows), NCCL's own buffers, the
CUDA context (about 0.5-1 GiB per GPU: `cluster.reserved_bytes` leaves room for them), the tiny
integer routing tables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from mop.build import storage_dtype
from mop.config import Config
from mop.models.config import ModelConfig
from mop.parallel.parallelize import compute_dtype
from mop.parallel.vocab import default_token_block

FP32 = 4

# The paper's Table 3 rows (plus the residual stream and norms, which the paper folds into attention).
ROWS = ("dense_weights", "attention_activations", "residual_and_norms", "expert_weights", "moe_activations",
        "vocab_weights", "vocab_tile", "gradients", "optimizer_state")


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


def _shard(rows: int, ranks: int) -> int:
    """Rows of dim 0 one rank holds when FSDP2 shards `rows` over `ranks` (padded to a multiple)."""
    return -(-rows // ranks)


@functools.lru_cache(maxsize=16)
def _parameter_shapes(model: tuple) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the model built on the meta device (no memory, any size)."""
    from mop.models.transformer import MoETransformer

    with torch.device("meta"):
        full = MoETransformer(ModelConfig(*model))
    return tuple((name, tuple(param.shape)) for name, param in full.named_parameters())


def parameter_counts(model: ModelConfig, world: int, expert: int, vocab: int, tp: int = 1) -> ParameterCounts:
    return _parameter_counts(dataclasses.astuple(model), world, expert, vocab, tp)


@functools.lru_cache(maxsize=4096)
def _parameter_counts(model: tuple, world: int, expert: int, vocab: int, tp: int) -> ParameterCounts:
    """Every parameter of the model assigned to its shard as the strategies place it. `tp` > 1: the
    planner's tensor-parallel baseline, which splits every matrix over tp ranks and FSDP-shards
    over the world / tp."""
    dense = experts = head = total = 0
    units: dict[str, int] = {}
    fsdp = world // tp
    for name, shape in _parameter_shapes(model):
        rows, row, numel = shape[0], math.prod(shape[1:]), math.prod(shape)
        split = tp if len(shape) > 1 else 1
        total += numel
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        if ".experts." in name:  # [E, ...]: E/Ep experts per partition, sharded over W/Ep replicas
            per_partition = rows // expert
            units[f"{unit}.experts"] = units.get(f"{unit}.experts", 0) + per_partition * row // split
            experts += _shard(per_partition, max(1, fsdp // expert)) * row // split
        elif name == "lm_head.weight" and vocab > 1:
            head += _shard(rows, vocab) * row
        else:
            units[unit] = units.get(unit, 0) + numel // split
            dense += _shard(rows, fsdp) * row // split
    blocks = [v for k, v in units.items() if not k.endswith("experts") and k != "root"]
    partitions = [v for k, v in units.items() if k.endswith(".experts")]
    return ParameterCounts(dense, experts, head, total, max(partitions, default=0), max(blocks))


@dataclass
class Moment:
    """Bytes by row at one moment of the step."""

    name: str
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROWS, 0))

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

    @property
    def peak_device_bytes(self) -> int:
        return self.peak.total

    @property
    def host_bytes_per_node(self) -> int:
        return self.ranks_per_node * sum(self.host_bytes_per_rank.values())


@dataclass(frozen=True)
class Shapes:
    """Per-rank, per-micro-batch token counts and the widths the activation terms use."""

    T: int  # tokens
    A: int  # routed token-expert assignments
    R: int  # rows this rank's expert GEMMs compute
    H: int
    q: int  # query width heads x head_dim
    kv: int  # key/value width kv_heads x head_dim
    d: int
    heads: int
    kv_heads: int
    E: int
    k: int
    I: int  # noqa: E741 - the paper's name for the expert width
    shared: int
    act: int  # bytes of an activation element (the compute dtype)


def shapes(config: Config, world: int, routing_skew: float = 1.0, tp: int = 1) -> Shapes:
    m, p = config.model, config.parallel
    tokens = config.train.micro_batch * config.data.seq_len // p.sequence
    assigned = tokens * m.top_k
    if p.expert > 1 and p.expert_balance == "llep":
        rows = math.ceil(p.llep_alpha * assigned)
    else:
        rows = math.ceil(min(routing_skew, p.expert) * assigned) if p.expert > 1 else assigned
    act = torch.finfo(compute_dtype(config)).bits // 8
    # Tensor parallelism (planner baseline only) with sequence parallelism splits every activation of
    # a block over its tp ranks: along the tokens outside attention and the MLPs, along heads and the
    # expert width inside; either way each term below shrinks by tp, which dividing the tokens does.
    return Shapes(tokens // tp, assigned // tp, rows // tp, m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim,
                  m.head_dim, m.heads, m.kv_heads, m.experts, m.top_k, m.expert_intermediate,
                  m.shared_expert_intermediate, act)


def _norm(s: Shapes, width: int, tokens: int | None = None) -> int:
    """One RMSNorm's saved tensors: the fp32 normalised product and inverse rms (and the fp32 copy of
    a low-precision input), plus its output, which the next matmul saves."""
    tokens = s.T if tokens is None else tokens
    upcast = tokens * width * FP32 if s.act < FP32 else 0
    return tokens * width * (FP32 + s.act) + tokens * FP32 + upcast


def _attention_saved(s: Shapes, model: ModelConfig, head_chunks: int) -> int:
    """What one attention layer keeps for its backward (q/k norms, RoPE tables, the core's tensors)."""
    qk = _norm(s, model.head_dim, s.T * s.heads) + _norm(s, model.head_dim, s.T * s.kv_heads) if model.qk_norm else 0
    rope = 2 * s.T * s.d * s.act
    local_qkv = s.T * (s.q + 2 * s.kv) * s.act
    if head_chunks > 1:  # `_HeadChunkedAttention` saves the local q, k, v; its output feeds o_proj
        return qk + rope + local_qkv + s.T * s.q * s.act
    # the head-sharded q/k/v and output (under D = 1 the kernel's own inputs and output), the
    # softmax statistics, and o_proj's input (the output back in the sequence-sharded layout)
    return qk + rope + local_qkv + 2 * s.T * s.q * s.act + s.T * s.heads * FP32


def _router_saved(s: Shapes) -> int:
    """fp32 probabilities [T, E], top-k weights and ids, their renormalising sums."""
    return s.T * s.E * FP32 + s.T * s.k * (2 * FP32 + 8) + s.T * FP32


def _experts_saved(s: Shapes, llep_chunks: int) -> int:
    """Unchunked: the gathered send rows, the received rows, the rows sent back (which the combine
    weighting keeps), the [R, 2I] gate/up output, silu and the product; chunked: only the output."""
    if llep_chunks > 1:
        return s.T * s.H * s.act
    return (2 * s.A + s.R) * s.H * s.act + 4 * s.R * s.I * s.act


def _experts_forward_peak(s: Shapes, llep_chunks: int) -> int:
    """Live at the expert GEMMs in forward beyond what stays saved: the unchunked path's own
    tensors up to the product (the rows sent back are not yet allocated); chunked: two chunks of
    rows in flight each way, one chunk's intermediate, the output accumulator."""
    if llep_chunks > 1:
        rows, assigned = -(-s.R // llep_chunks), -(-s.A // llep_chunks)
        return (4 * assigned + 3 * rows) * s.H * s.act + 4 * rows * s.I * s.act + s.T * s.H * s.act
    return (s.A + s.R) * s.H * s.act + 4 * s.R * s.I * s.act


def _experts_backward_peak(s: Shapes, llep_chunks: int) -> int:
    """Relative to the saved tensors, the expert backward at its widest, the SwiGLU's: plus the
    gradients of the product, of silu and of up and the block's output gradient, less the product
    and the rows gathered to send and sent back, which the backward has released by then (only the
    received rows stay, for the first GEMM's weight gradient). Chunked (`ChunkedExperts.backward`):
    the chunk being computed, [rows | output gradients] (2H wide), with the next chunk's message on
    its way in and the previous chunk's [row gradients | outputs] on its way back (each a send and
    a receive buffer), the pieces that message was cut from (the chunk's token rows and their
    weighted output gradients) and the gradient of the received rows, the chunk's recomputed
    intermediate and its gradients, and the input's gradient accumulator."""
    if llep_chunks > 1:
        rows, assigned = -(-s.R // llep_chunks), -(-s.A // llep_chunks)
        in_flight = rows + min(2, llep_chunks - 1) * (assigned + rows)
        pieces = 2 * assigned + rows
        return ((in_flight * 2 + pieces) * s.H + 7 * rows * s.I) * s.act + s.T * s.H * (FP32 + s.act)
    return (2 * s.R * s.I - 2 * s.A * s.H) * s.act + s.T * s.H * FP32


def _mlp_saved(s: Shapes, width: int) -> int:
    """A SwiGLU MLP (dense block or shared expert): gate and up outputs, silu, the product."""
    return 4 * s.T * width * s.act


def _block_saved(s: Shapes, config: Config, moe: bool) -> dict[str, int]:
    """One block's saved activations by row, without checkpointing: the block input and the
    residual after attention (each saved by the norm that reads it), the two norms, attention,
    and the MoE layer (router and experts, plus the shared expert) or the dense MLP."""
    m, p = config.model, config.parallel
    rows = dict.fromkeys(ROWS, 0)
    rows["residual_and_norms"] = 2 * s.T * s.H * s.act + 2 * _norm(s, s.H)
    rows["attention_activations"] = _attention_saved(s, m, p.attention_head_chunks)
    if moe:
        rows["moe_activations"] = (_router_saved(s) + _experts_saved(s, p.llep_chunks)
                                   + (_mlp_saved(s, s.shared) if s.shared else 0))
    else:
        rows["moe_activations"] = _mlp_saved(s, m.dense_intermediate)
    return rows


def _block_kept(s: Shapes, config: Config) -> dict[str, int]:
    """What full activation checkpointing keeps of one block on the device: its input, and the
    outputs of the chunked parts (`mop.parallel.checkpointing`); nothing with offload."""
    rows = dict.fromkeys(ROWS, 0)
    if config.train.offload_activations:
        return rows
    p = config.parallel
    rows["residual_and_norms"] = s.T * s.H * s.act
    rows["attention_activations"] = s.T * s.q * s.act if p.attention_head_chunks > 1 else 0
    rows["moe_activations"] = s.T * s.H * s.act if p.llep_chunks > 1 else 0
    return rows


def _on_device(config: Config) -> Config:
    """The config with activation offload off: what offload would otherwise keep on the device."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, offload_activations=False))


def _add(total: dict[str, int], part: dict[str, int], times: int = 1) -> None:
    for row, value in part.items():
        total[row] += value * times


def _loss_working_set(s: Shapes, config: Config) -> dict[str, int]:
    """The loss's own tensors at its widest (the backward), beyond the hidden states it reads."""
    m, p = config.model, config.parallel
    rows = dict.fromkeys(ROWS, 0)
    if p.vocab > 1:  # the ring: one fp32 tile, the incoming shard, the gradient buffer and its successor
        shard_rows = -(-m.vocab_size // p.vocab)
        block = min(s.T, p.vocab_token_block or default_token_block(shard_rows))
        rows["vocab_tile"] = block * shard_rows * FP32 + s.T * s.H * FP32 + 4 * s.T * FP32
        rows["vocab_weights"] = shard_rows * s.H * (s.act + (s.act if s.act < FP32 else 0))
        rows["gradients"] = 2 * shard_rows * s.H * FP32
    else:  # the full fp32 logits' log-softmax (saved), the loss gradient and the log-softmax gradient
        rows["vocab_tile"] = 3 * s.T * m.vocab_size * FP32
    return rows


def micro_batches(config: Config, world: int) -> int:
    """Forward passes per optimizer step on a rank (`TrainingRun.micro_batches_per_step`)."""
    return config.train.global_batch // (world // config.parallel.sequence) // config.train.micro_batch


def estimate(config: Config, world: int, ranks_per_node: int, routing_skew: float = 1.0,
             tp: int = 1) -> MemoryEstimate:
    """The device peak of one rank and the host memory of one node for the resolved `config` on
    `world` ranks (see the module docstring); `tp` > 1 only for the planner's TP baseline."""
    m, p, t = config.model, config.parallel, config.train
    s = shapes(config, world, routing_skew, tp)
    counts = parameter_counts(m, world, p.expert, p.vocab, tp)
    stored = torch.finfo(storage_dtype(config)).bits // 8
    host_optimizer, fsdp_offload = config.optim.offload, p.fsdp_cpu_offload
    # Persistent: the shards (on the host under FSDP2's CPU offload), torch AdamW's moments, and
    # its gradients once a micro-batch has made them (the host optimizer takes each at hand-over).
    base = dict.fromkeys(ROWS, 0)
    if not fsdp_offload:
        base["dense_weights"] = counts.dense * stored
        base["expert_weights"] = counts.experts * stored
        base["vocab_weights"] = counts.vocab * stored
        if not host_optimizer:
            base["optimizer_state"] = 2 * counts.local * FP32
            if micro_batches(config, world) > 1:
                base["gradients"] = counts.local * stored
    # Gathered by FSDP2 while the model runs: the root unit (embedding, final norm, and the output
    # projection without vocabulary parallelism), which FSDP2 keeps unsharded from its forward to
    # its backward, all step long; inside a block, its unit and the one prefetched, and the
    # running layer's expert partition (plus one expert LLEP ships in).
    base["dense_weights"] += m.vocab_size * m.hidden * (1 if p.vocab > 1 or m.tie_embeddings else 2) // tp * s.act
    in_block = dict.fromkeys(ROWS, 0)
    in_block["dense_weights"] = 2 * counts.largest_dense_unit * s.act
    shipped = 3 * m.hidden * m.expert_intermediate // tp if p.expert > 1 and p.expert_balance == "llep" else 0
    in_block["expert_weights"] = (counts.expert_partition + shipped) * s.act

    checkpointed = t.activation_checkpointing == "full"
    moe_block = _block_saved(s, config, moe=True)
    dense_block = _block_saved(s, config, moe=False)
    kept = _block_kept(s, config)

    def blocks(count_moe: int, count_dense: int) -> dict[str, int]:
        rows = dict.fromkeys(ROWS, 0)
        if checkpointed:
            _add(rows, kept, count_moe + count_dense)
        else:
            _add(rows, moe_block, count_moe)
            _add(rows, dense_block, count_dense)
        return rows

    moe_layers, dense_layers = m.moe_layers, m.dense_layers
    last_is_moe = moe_layers > 0
    # 1. forward, the last block's experts
    forward = Moment("forward: last block's expert GEMMs", dict(base))
    _add(forward.rows, in_block)
    _add(forward.rows, blocks(moe_layers - last_is_moe, dense_layers - (not last_is_moe)))
    current = dict(moe_block if last_is_moe else dense_block)
    if checkpointed:  # only what the block's code still holds: nothing is saved inside a checkpoint
        current = dict.fromkeys(ROWS, 0)
        current["residual_and_norms"] = 3 * s.T * s.H * s.act
        current["moe_activations"] = _router_saved(s)
    else:
        current["moe_activations"] -= _experts_saved(s, p.llep_chunks) if last_is_moe else 0
    _add(forward.rows, current)
    if last_is_moe:
        forward.rows["moe_activations"] += _experts_forward_peak(s, p.llep_chunks)
    # 2. the loss
    loss = Moment("loss: the vocabulary projection's backward", dict(base))
    _add(loss.rows, blocks(moe_layers, dense_layers))
    loss.rows["residual_and_norms"] += s.T * s.H * s.act + _norm(s, s.H)
    _add(loss.rows, _loss_working_set(s, config))
    # 3. backward, the last block's experts: their saved tensors (recomputed under checkpointing),
    # the gradients flowing through them, and the unsharded gradients of the gathered units
    backward = Moment("backward: last block's experts", dict(base))
    _add(backward.rows, in_block)
    _add(backward.rows, blocks(moe_layers, dense_layers))
    if checkpointed:  # the block recomputed from its kept input (back from the host with offload)
        _add(backward.rows, moe_block if last_is_moe else dense_block)
        backward.rows["residual_and_norms"] -= s.T * s.H * s.act  # the input is the kept one
        if t.offload_activations:
            _add(backward.rows, _block_kept(s, _on_device(config)))
    if last_is_moe:
        # autograd runs the later-created shared expert's backward first: its tensors are gone
        backward.rows["moe_activations"] += _experts_backward_peak(s, p.llep_chunks) - _mlp_saved(s, s.shared)
        # the unsharded gradients of the running units, and of the expert LLEP shipped in
        backward.rows["gradients"] += (counts.expert_partition + counts.largest_dense_unit + shipped) * FP32
    moments = [forward, loss, backward]
    return MemoryEstimate(max(moments, key=lambda x: x.total), moments, host_bytes(config, counts, s, world),
                          ranks_per_node)


def host_bytes(config: Config, counts: ParameterCounts, s: Shapes, world: int) -> dict[str, int]:
    """Host memory one rank uses on a GPU machine, by kind.

    Host optimizer (`mop.optim.host_adamw`): the fp32 master, the two moments, their rollback
    spares (with `optim.speculative`), the fp32 gradient accumulator and the pinned staging buffer a
    gradient is copied into (in the stored dtype): 28 (16 without the spares) bytes + the stored
    dtype per parameter. FSDP2's CPU offload: the fp32
    shards, their gradients and torch AdamW's moments. Offloaded activations: every block's kept
    tensors (`_block_kept` without offload), pinned."""
    rows = {"optimizer": 0, "parameters": 0, "activations": 0}
    stored = torch.finfo(storage_dtype(config)).bits // 8
    if config.optim.offload:
        rows["optimizer"] = counts.local * ((7 if config.optim.speculative else 4) * FP32 + stored)
    if config.parallel.fsdp_cpu_offload:
        rows["parameters"] = counts.local * 2 * FP32
        rows["optimizer"] = counts.local * 2 * FP32
    if config.train.offload_activations:
        rows["activations"] = config.model.layers * sum(_block_kept(s, _on_device(config)).values())
    return rows
