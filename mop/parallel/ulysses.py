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
        outputs = []
        for plan in self.plans:
            if len(self.plans) == 1:
                outputs.append(self._chunk(plan, q, k, v, full_documents))
            else:
                outputs.append(checkpoint(self._chunk, plan, q, k, v, full_documents, use_reentrant=False))
        batch, tokens = q.shape[:2]
        # outputs[c]: [D, B, N, heads per chunk, d] from rank j; global head = j*H/D + c*H/(DC) + i.
        stacked = torch.stack(outputs)
        return stacked.permute(2, 3, 1, 0, 4, 5).reshape(batch, tokens, -1, q.shape[-1])

    def _gather_sequence(self, document_ids: torch.Tensor) -> torch.Tensor:
        gathered = all_gather_rows(document_ids, self.group)  # [D*B, N], rank-major
        batch, tokens = document_ids.shape
        return gathered.view(self.ranks, batch, tokens).permute(1, 0, 2).reshape(batch, self.ranks * tokens)

    def _chunk(self, plan: ChunkPlan, q, k, v, full_documents):
        batch, tokens, _, dim = q.shape
        pieces = [torch.cat([q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb]], dim=2)
                  for (qa, qb), (ka, kb) in zip(plan.query, plan.kv)]
        in_splits = [piece.numel() for piece in pieces]
        mine_q, mine_kv = plan.query[self.rank], plan.kv[self.rank]
        queries, kvs = mine_q[1] - mine_q[0], mine_kv[1] - mine_kv[0]
        out_splits = [batch * tokens * (queries + 2 * kvs) * dim] * self.ranks
        received = all_to_all(torch.cat([p.reshape(-1) for p in pieces]), out_splits, in_splits, self.group)
        received = received.view(self.ranks, batch, tokens, queries + 2 * kvs, dim)
        received = received.permute(1, 0, 2, 3, 4).reshape(batch, self.ranks * tokens, queries + 2 * kvs, dim)
        q_heads, k_heads, v_heads = received.split([queries, kvs, kvs], dim=2)
        index = kv_index(mine_q, mine_kv, self.group_size)
        if index is not None:
            k_heads, v_heads = k_heads.index_select(2, index), v_heads.index_select(2, index)
        out = self.core(q_heads, k_heads, v_heads, full_documents)  # [B, S, queries, d]
        send = out.view(batch, self.ranks, tokens, queries, dim).transpose(0, 1).reshape(-1)
        returned = all_to_all(send, [send.numel() // self.ranks] * self.ranks, [send.numel() // self.ranks] * self.ranks,
                              self.group)
        return returned.view(self.ranks, batch, tokens, queries, dim)


def apply_sequence_parallel(model: MoETransformer, group: dist.ProcessGroup, head_chunks: int) -> None:
    """Swap every block's attention core for the Ulysses core over `group`."""
    cfg = model.cfg
    for block in model.layers:
        block.attention.core = UlyssesAttention(group, cfg.heads, cfg.kv_heads, head_chunks)


def reduce_router_stats(stats: RouterStats, group: dist.ProcessGroup) -> RouterStats:
    """Sum each sequence's router statistics over the ranks holding its slices (with gradient)."""
    return RouterStats(all_reduce_sum(stats.assignments, group), all_reduce_sum(stats.prob_sum, group),
                       all_reduce_sum(stats.rows, group))
