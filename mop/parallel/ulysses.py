"""Ulysses sequence parallelism for attention, processed in head chunks.

Layout. The D ranks of a sequence group hold consecutive slices of the same sequences: rank i
holds tokens `[i*N, (i+1)*N)` (N = S/D) of every row, with their global positions and document
ids. Everything outside attention (norms, projections, RoPE at global positions, MoE, loss) runs
on those N tokens unchanged. Only the sequence-mixing core needs whole sequences, so it is the
module this file replaces (`Attention.core`).

Communication, per head chunk c (C = parallel.attention_head_chunks chunks of the H/D query heads
each rank owns):
1. one all-to-all sends, to each rank j, this rank's N tokens of the query heads j owns in chunk
   c together with the key/value heads those queries read (Q, K and V in one collective); rank j
   receives all S tokens of them (sequence-sharded -> head-sharded);
2. causal attention with the packed-document mask (the reference's own `AttentionCore`) runs on
   whole sequences for those heads;
3. one all-to-all returns each rank's N tokens of the output heads (head-sharded -> sequence-
   sharded).
The document ids of the whole sequence are all-gathered once per layer (integers, no gradient).
Backward runs the inverse exchanges (`comms.all_to_all`).

Grouped-query attention: query head h reads KV head h // (H / KV). Rank j's chunk needs only the
KV heads its query heads read, so each KV head goes to exactly the ranks (and chunks) that need
it: once in total when KV >= D and the head groups align with the chunks; replicated to the
D/KV ranks sharing it when KV < D (the minimum, since each of them reads it); re-sent per chunk
when several chunks of one rank read the same KV head (the price of holding one chunk at a time).

Memory. Only one chunk's head-sharded Q/K/V/output and attention temporaries are live at a time
in the forward. With C > 1 each chunk is also checkpointed: the backward re-runs its exchange and
attention, so the backward too holds one chunk at a time (one extra exchange and attention
forward per chunk). C = 1 is plain Ulysses and recomputes nothing.

Invariants: heads are independent in attention, so the result equals the single-device
computation up to floating-point summation order; every rank issues the same collectives in the
same order (forward, recomputation and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mop.models.attention import AttentionCore
from mop.models.moe import RouterStats
from mop.models.transformer import MoETransformer
from mop.parallel.comms import all_gather_rows, all_reduce_sum, all_to_all


@dataclass(frozen=True)
class ChunkPlan:
    """Head ranges `[start, stop)` that each destination rank receives for one head chunk."""

    query: list[tuple[int, int]]
    kv: list[tuple[int, int]]


def head_plan(heads: int, kv_heads: int, ranks: int, chunks: int) -> list[ChunkPlan]:
    """For each chunk: the query heads and the KV heads they read, per destination rank."""
    per_rank = heads // ranks
    per_chunk = per_rank // chunks
    group = heads // kv_heads
    plans = []
    for c in range(chunks):
        query = [(j * per_rank + c * per_chunk, j * per_rank + (c + 1) * per_chunk) for j in range(ranks)]
        kv = [(start // group, (stop - 1) // group + 1) for start, stop in query]
        plans.append(ChunkPlan(query, kv))
    return plans


def kv_index(query: tuple[int, int], kv: tuple[int, int], group: int) -> torch.Tensor | None:
    """Local KV head read by each local query head, or None when SDPA's GQA broadcast expresses it."""
    index = torch.tensor([h // group - kv[0] for h in range(*query)])
    queries, kvs = query[1] - query[0], kv[1] - kv[0]
    if queries % kvs == 0 and torch.equal(index, torch.arange(kvs).repeat_interleave(queries // kvs)):
        return None
    return index


class UlyssesAttention(nn.Module):
    """Drop-in `Attention.core` for a sequence group; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup, heads: int, kv_heads: int, head_chunks: int):
        super().__init__()
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.group_size = heads // kv_heads
        self.plans = head_plan(heads, kv_heads, self.ranks, head_chunks)
        self.core = AttentionCore()

    def forward(self, q, k, v, document_ids):
        full_documents = None if document_ids is None else self._gather_sequence(document_ids)
        batch, tokens, heads, dim = q.shape
        chunks = len(self.plans)
        # Query heads grouped [chunk][destination rank] as views, split once: the backward then
        # assembles q's gradient in one tensor instead of zero-padding one per chunk.
        q_chunks = q.unflatten(2, (self.ranks, chunks, heads // (self.ranks * chunks))).permute(3, 2, 0, 1, 4, 5)
        outputs = []
        for plan, q_chunk in zip(self.plans, q_chunks.unbind(0)):
            if chunks == 1:
                outputs.append(self._chunk(plan, q_chunk, k, v, full_documents))
            else:
                outputs.append(checkpoint(self._chunk, plan, q_chunk, k, v, full_documents, use_reentrant=False))
        # outputs[c]: [B, N, D, heads per chunk, d]; global head = j*H/D + c*H/(DC) + i.
        return torch.stack(outputs, dim=3).flatten(2, 4)

    def _gather_sequence(self, document_ids: torch.Tensor) -> torch.Tensor:
        gathered = all_gather_rows(document_ids, self.group)  # [D*B, N], rank-major
        batch, tokens = document_ids.shape
        return gathered.view(self.ranks, batch, tokens).permute(1, 0, 2).reshape(batch, self.ranks * tokens)

    def _chunk(self, plan: ChunkPlan, q_chunk, k, v, full_documents):
        """One head chunk: `q_chunk [D, B, N, heads per chunk, d]` holds each destination's query heads."""
        batch, tokens, _, dim = k.shape
        # Send buffer, per destination rank: its query heads, then its K heads, then its V heads,
        # each [B, N, heads, d]; filled in place, so the buffer is the only copy.
        parts = [piece for j, (ka, kb) in enumerate(plan.kv) for piece in (q_chunk[j], k[:, :, ka:kb], v[:, :, ka:kb])]
        sizes = [part.numel() for part in parts]
        send = k.new_empty(sum(sizes))
        offset = 0
        for part, size in zip(parts, sizes):
            send.narrow(0, offset, size).view(part.shape).copy_(part)
            offset += size
        in_splits = [sum(sizes[3 * j:3 * j + 3]) for j in range(self.ranks)]
        (qa, qb), (ka, kb) = plan.query[self.rank], plan.kv[self.rank]
        mine = [qb - qa, kb - ka, kb - ka]
        received = all_to_all(send, [in_splits[self.rank]] * self.ranks, in_splits, self.group)
        q_heads, k_heads, v_heads = (
            part.reshape(self.ranks, batch, tokens, heads, dim).transpose(0, 1).reshape(batch, -1, heads, dim)
            for part, heads in zip(received.view(self.ranks, -1).split([batch * tokens * h * dim for h in mine], 1), mine))
        index = kv_index(plan.query[self.rank], plan.kv[self.rank], self.group_size)
        if index is not None:
            index = index.to(k_heads.device)
            k_heads, v_heads = k_heads.index_select(2, index), v_heads.index_select(2, index)
        out = self.core(q_heads, k_heads, v_heads, full_documents)  # [B, S, queries, d]
        send_back = out.reshape(batch, self.ranks, tokens, mine[0], dim).transpose(0, 1).reshape(-1)
        splits = [send_back.numel() // self.ranks] * self.ranks
        returned = all_to_all(send_back, splits, splits, self.group)
        return returned.view(self.ranks, batch, tokens, mine[0], dim).permute(1, 2, 0, 3, 4)


def apply_sequence_parallel(model: MoETransformer, group: dist.ProcessGroup, head_chunks: int) -> None:
    """Swap every block's attention core for the Ulysses core over `group`."""
    cfg = model.cfg
    for block in model.layers:
        block.attention.core = UlyssesAttention(group, cfg.heads, cfg.kv_heads, head_chunks)


def reduce_router_stats(stats: RouterStats, group: dist.ProcessGroup) -> RouterStats:
    """Sum each sequence's router statistics over the ranks holding its slices (with gradient)."""
    return RouterStats(all_reduce_sum(stats.assignments, group), all_reduce_sum(stats.prob_sum, group),
                       all_reduce_sum(stats.rows, group))
