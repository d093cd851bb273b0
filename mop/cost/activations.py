"""What activations a rank holds at the moments `mop.cost.memory` weighs, in bytes, per micro-batch.

Each function reads one piece of the runtime and says which of its tensors are alive: what
autograd saves per block (RMSNorm, attention with its q/k norms, RoPE tables and core, the router,
the experts, SwiGLU MLPs), what activation checkpointing keeps per block, and the extra working
set of the expert layer and of the loss at their widest. Element counts follow the shapes the code
allocates; bytes follow the compute dtype (`Shapes.act`), except what the code keeps in fp32
(RMSNorm internals, router probabilities, logit tiles, gradient accumulators).

Token counts per rank and micro-batch: T = micro_batch x seq_len / D; A = T k routed
assignments; R = ceil(llep_alpha x A) rows computed under LLEP (its capacity: the plan never puts
more on a rank unless a chunk below llep_min_chunk is forced), A x `routing_skew` under plain EP
(the load of the busiest rank relative to the mean, which the data decides; 1.0 = balanced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mop.config import Config
from mop.models.families import model_spec
from mop.models.spec import FP32, norm_saved_bytes
from mop.parallel.vocab import default_token_block

# The paper's Table 3 rows (plus the residual stream and norms, which the paper folds into attention).
ROWS = ("dense_weights", "attention_activations", "residual_and_norms", "expert_weights", "moe_activations",
        "vocab_weights", "vocab_tile", "gradients", "optimizer_state")


def rows() -> dict[str, int]:
    return dict.fromkeys(ROWS, 0)


@dataclass(frozen=True)
class Shapes:
    """Per-rank, per-micro-batch token counts and the widths the activation terms use."""

    T: int  # tokens
    A: int  # routed token-expert assignments
    R: int  # rows this rank's expert GEMMs compute
    H: int
    E: int
    k: int
    I: int  # noqa: E741 - the paper's name for the expert width
    shared: int
    act: int  # bytes of an activation element (the compute dtype)


def shapes(config: Config, routing_skew: float = 1.0, tp: int = 1) -> Shapes:
    m, p = config.model, config.parallel
    tokens = config.train.micro_batch * config.data.seq_len // p.sequence
    assigned = tokens * m.top_k
    if p.expert > 1 and p.expert_balance == "llep":
        computed = math.ceil(p.llep_alpha * assigned)
    else:
        computed = math.ceil(min(routing_skew, p.expert) * assigned) if p.expert > 1 else assigned
    act = config.compute_dtype.itemsize
    # Tensor parallelism (planner baseline only) with sequence parallelism splits every activation of
    # a block over its tp ranks: along the tokens outside attention and the MLPs, along heads and the
    # expert width inside; either way each term below shrinks by tp, which dividing the tokens does.
    return Shapes(tokens // tp, assigned // tp, computed // tp, m.hidden, m.experts, m.top_k, m.expert_intermediate,
                  m.shared_expert_intermediate, act)


def norm(s: Shapes, width: int) -> int:
    """One RMSNorm over `width` on every token (`mop.models.spec.norm_saved_bytes`)."""
    return s.T * norm_saved_bytes(width, s.act)


def router_saved(s: Shapes) -> int:
    """fp32 probabilities [T, E], top-k weights and ids, their renormalising sums."""
    return s.T * s.E * FP32 + s.T * s.k * (2 * FP32 + 8) + s.T * FP32


def experts_saved(s: Shapes, llep_chunks: int) -> int:
    """Unchunked: the gathered send rows, the received rows, the rows sent back (which the combine
    weighting keeps), the [R, 2I] gate/up output, silu and the product; chunked: only the output."""
    if llep_chunks > 1:
        return s.T * s.H * s.act
    return (2 * s.A + s.R) * s.H * s.act + 4 * s.R * s.I * s.act


def experts_forward_peak(s: Shapes, llep_chunks: int) -> int:
    """Live at the expert GEMMs in forward beyond what stays saved: the unchunked path's own
    tensors up to the product (the rows sent back are not yet allocated); chunked: two chunks of
    rows in flight each way, one chunk's intermediate, the output accumulator."""
    if llep_chunks > 1:
        rows, assigned = -(-s.R // llep_chunks), -(-s.A // llep_chunks)
        return (4 * assigned + 3 * rows) * s.H * s.act + 4 * rows * s.I * s.act + s.T * s.H * s.act
    return (s.A + s.R) * s.H * s.act + 4 * s.R * s.I * s.act


def experts_backward_peak(s: Shapes, llep_chunks: int) -> int:
    """Relative to the saved tensors, the expert backward at its widest, the SwiGLU's: plus the
    gradients of the product, of silu and of up and the block's output gradient, less the product
    and the rows gathered to send and sent back, which the backward has released by then (only the
    received rows stay, for the first GEMM's weight gradient). Chunked (`ChunkedExperts.backward`):
    the chunk being computed, its received [rows | output gradients | weight] message (2H + 16
    bytes wide) gathered by expert, the next chunk's message on its way in and, in a middle chunk,
    also the previous chunk's [row gradients | weight gradient] (H + 1 wide) on its way back (each
    a send and a receive buffer), the chunk's recomputed gate/up output, silu, product and probe
    product and two gradients, the block's output gradient and the input's gradient accumulator.
    Not counted: on CUDA the grouped GEMM's aligned copies of the chunk's rows and probe
    (`swiglu_experts` pads each expert's group), 2 x rows x H more."""
    if llep_chunks > 1:
        rows, assigned = -(-s.R // llep_chunks), -(-s.A // llep_chunks)
        message, reply = 2 * s.H * s.act + 16, (s.H + 1) * s.act
        in_flight = rows * message + (rows + assigned) * (message + (reply if llep_chunks > 2 else 0))
        return in_flight + 7 * rows * s.I * s.act + 2 * s.T * s.H * s.act
    return (2 * s.R * s.I - 2 * s.A * s.H) * s.act + s.T * s.H * FP32


def mlp_saved(s: Shapes, width: int) -> int:
    """A SwiGLU MLP (dense block or shared expert): gate and up outputs, silu, the product."""
    return 4 * s.T * width * s.act


def block_saved(s: Shapes, config: Config, moe: bool) -> dict[str, int]:
    """One block's saved activations by row, without checkpointing: the block input and the
    residual after attention (each saved by the norm that reads it), the two norms, attention,
    and the MoE layer (router and experts, plus the shared expert) or the dense MLP."""
    m, p = config.model, config.parallel
    out = rows()
    out["residual_and_norms"] = 2 * s.T * s.H * s.act + 2 * norm(s, s.H)
    out["attention_activations"] = s.T * model_spec(m).attention.saved_bytes_per_token(s.act, p.attention_head_chunks)
    if moe:
        out["moe_activations"] = (router_saved(s) + experts_saved(s, p.llep_chunks)
                                   + (mlp_saved(s, s.shared) if s.shared else 0))
        if _frozen_moe_input(config, s):  # the frozen router's matmul saves no input
            out["residual_and_norms"] -= s.T * s.H * s.act
    else:
        out["moe_activations"] = mlp_saved(s, m.dense_intermediate)
    return out


def _frozen_moe_input(config: Config, s: Shapes) -> bool:
    """Under LoRA the MoE layer's normed input is saved by no matmul unless a shared expert has
    adapters (the routed experts' adapters read the dispatched rows, which `experts_saved` counts)."""
    lora = config.adapters
    return lora is not None and not (s.shared and "shared_experts" in lora.target_list())


def block_kept(s: Shapes, config: Config) -> dict[str, int]:
    """What full activation checkpointing keeps of one block until its backward: its input, and
    head-chunked attention's output (`mop.parallel.checkpointing`; chunked LLEP keeps none); on the
    host with offload."""
    out = rows()
    p = config.parallel
    out["residual_and_norms"] = s.T * s.H * s.act
    out_width = model_spec(config.model).attention.out_width
    out["attention_activations"] = s.T * out_width * s.act if p.attention_head_chunks > 1 else 0
    return out


def add(total: dict[str, int], part: dict[str, int], times: int = 1) -> None:
    for row, value in part.items():
        total[row] += value * times


def padded_vocab(vocab: int, shards: int) -> int:
    """The rows of a projection of `vocab` rows split into `shards` equal row shards."""
    return -(-vocab // shards) * shards


def loss_working_set(s: Shapes, config: Config) -> dict[str, int]:
    """The loss's own tensors at its widest (the backward), beyond the hidden states it reads."""
    m, p = config.model, config.parallel
    out = rows()
    heads = 1 + m.trained_mtp_layers  # each MTP depth has a head of its own (`mop.models.mtp`)
    kept = p.vocab_logits != "recompute"
    if p.vocab > 1:  # the ring: one fp32 tile (kept: every head's tiles of the rank's tokens, the one at work among
        # them, `mop.parallel.vocab`), the incoming shard, the gradient buffer and its successor
        shard_rows = -(-m.vocab_size // p.vocab)
        block = min(s.T, p.vocab_token_block or default_token_block(shard_rows))
        tiles = heads * s.T * padded_vocab(m.vocab_size, p.vocab) if kept else block * shard_rows
        out["vocab_tile"] = tiles * FP32 + s.T * s.H * FP32 + 4 * s.T * FP32
        out["vocab_weights"] = shard_rows * s.H * (s.act + (s.act if s.act < FP32 else 0))
        out["gradients"] = 2 * shard_rows * s.H * FP32 if config.adapters is None else 0  # a frozen head has none
    elif not kept:  # one rank in tiles (`TiledHead`): a block's logits, softmax and gradient at a time
        block = p.vocab_token_block or default_token_block(m.vocab_size)
        out["vocab_tile"] = 3 * min(s.T, block) * m.vocab_size * FP32
    else:  # the full fp32 logits' log-softmax (saved), the loss gradient and the log-softmax gradient, and each
        # MTP depth's head's saved log-softmax beside them
        out["vocab_tile"] = (2 + heads) * s.T * m.vocab_size * FP32
    return out
