"""`parallelize(model, layout, config)`: apply each technique of the `mop` strategy, in order.

Order (each step touches only the modules it owns; later steps wrap what earlier ones built):
1. Ulysses sequence parallelism swaps every `Attention.core` and the model's `documents` (the
   document spans of whole sequences, from ids gathered once per forward) (when
   parallel.sequence > 1);
2. expert parallelism swaps the experts module for `ExpertParallel` (EP or LLEP over the expert
   group) and FSDP2-shards each expert partition over its expert-replica group (when
   parallel.expert > 1);
3. the vocabulary-parallel loss swaps `LMHead` for a row shard over the vocabulary group and the
   ring cross-entropy (when parallel.vocab > 1); the shard stays out of FSDP2;
4. activation checkpointing (and offload) wraps each block, so the recomputation includes the
   swapped modules and their collectives, except the chunked parts, which hand back their
   forward output (`mop.parallel.checkpointing`);
5. FSDP2 shards whatever weights remain over the world mesh (last: `fully_shard` must see the
   final module tree).

Per-rank sizes of what scales with the context S (N = S/D tokens per rank, B sequences per
micro-batch, H hidden, h query and kv key/value heads of d dims, E experts, k per token, C_a
attention head chunks, C_e LLEP chunks, P vocabulary ranks); none is O(S^2):
- input ids, labels, positions: `[B, N]` int64 each; document ids `[B, N]` int32, all-gathered
  once per forward to `[B, S]` int32 (transient) under Ulysses and turned into `Documents`:
  O(documents) integers plus pack masks of at most 256 bytes per token of short documents;
- RoPE tables: `[B, N, d]` cos and sin per layer; the residual stream and norms `[B, N, H]`;
- attention: local q/k/v/out `[B, N, (h + 2 kv) d]`; head-sharded, one chunk at a time,
  `[B, S, h/(D C_a), d]` (N h d / C_a elements) and the kernel's `[B, h/(D C_a), S]` statistics;
- router: logits and probabilities `[B N, E]` fp32, top-k ids and weights `[B N, k]`, the
  per-sequence sums `[B, E]`;
- experts: the `[Ep, E]` count matrix, routing tables of B N k integers, dispatch buffers and
  expert intermediates of about B N k (H + 2 I) / C_e elements;
- vocabulary: one `[token_block, V/P]` fp32 logit tile (independent of S) and `[B N]` fp32
  running statistics;
- activation checkpointing: per block `[B, N, H]` (plus the outputs of chunked parts, see
  `mop.parallel.checkpointing`), in host memory with offload.

"""

from __future__ import annotations

import torch

from mop.config import Config
from mop.models.transformer import MoETransformer
from mop.parallel.checkpointing import apply_activation_checkpointing, canonical_name
from mop.parallel.experts import shard_experts
from mop.parallel.fsdp import shard_dense
from mop.parallel.llep import BalanceOptions
from mop.parallel.mesh import DistLayout
from mop.parallel.placement import placements
from mop.parallel.ulysses import apply_sequence_parallel
from mop.parallel.vocab import apply_vocab_parallel, tile_vocabulary


def gather_dtype(config: Config) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in: the compute dtype, or each parameter's own under LoRA,
    whose frozen base is stored in the compute dtype or a published format that must reach the
    GEMM's dequantization as stored (and whose adapters autocast casts)."""
    return None if config.adapters is not None else config.compute_dtype


def apply_memory_options(model: MoETransformer, config: Config, device: torch.device) -> None:
    """The layout-independent memory options (also used by the reference strategy)."""
    if config.train.activation_checkpointing == "full":
        apply_activation_checkpointing(model, config.train.offload_activations, pin_memory=device.type == "cuda")
    if config.parallel.vocab == 1 and config.parallel.vocab_logits == "recompute":
        tile_vocabulary(model, config.parallel.vocab_token_block)


def parallelize(model: MoETransformer, layout: DistLayout, config: Config) -> MoETransformer:
    p = config.parallel
    if layout.layout.sequence > 1:
        apply_sequence_parallel(model, layout.sequence_group, p.attention_head_chunks)
    if layout.layout.expert > 1:
        options = BalanceOptions(p.expert_balance, p.llep_gate, p.llep_alpha, p.llep_min_chunk, p.llep_chunks)
        shard_experts(model, layout, options, gather_dtype(config))
    if layout.layout.vocab > 1:
        apply_vocab_parallel(model, layout, p.vocab_token_block, keep_logits=p.vocab_logits != "recompute")
    apply_memory_options(model, config, layout.device)
    shape = layout.layout
    record = placements(config.model, shape.world, shape.expert, shape.vocab, config.adapters)
    outside = {p for name, p in model.named_parameters() if not record[canonical_name(name)].fsdp_group}
    shard_dense(model, layout, gather_dtype(config), ignored=outside)  # the ring's shard stays out of FSDP2
    return model
