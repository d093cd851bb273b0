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
2. causal attention within each packed document (the reference's own `AttentionCore`, the same
   kernel as every other strategy) runs on whole sequences for those heads;
3. one all-to-all returns each rank's N tokens of the output heads (head-sharded -> sequence-
   sharded).
Documents: once per forward (not per layer or chunk), `SequenceDocumentBoundaries` all-gathers
the slices' document ids (int32, 4 bytes per token of the whole sequence, transient) and derives
the whole sequences' `Documents` (O(documents) host integers, cumulative lengths, and pack masks
of at most `PACK_TOKENS` bytes per token of the short documents), which every layer and chunk
reuses. Backward runs the inverse exchanges (`comms.all_to_all`). Multi-token prediction's
lookahead (`SequenceLookahead`, `mop.models.mtp`): once per forward, an all-gather of each slice's
first D tokens' ids, labels and positions (integers), the tokens after the previous slice's last.

Grouped-query attention: query head h reads KV head h // (H / KV). Rank j's chunk needs only the
KV heads its query heads read, so each KV head goes to exactly the ranks (and chunks) that need
it: once in total when KV >= D and the head groups align with the chunks; replicated to the
D/KV ranks sharing it when KV < D (the minimum, since each of them reads it); re-sent per chunk
when several chunks of one rank read the same KV head (the price of holding one chunk at a time).

Head widths: q and k share one, v (and so the output) may have another (multi-head latent
attention); each travels at its own width. Per-head values of the attention (gpt-oss's sinks, one
logit per query head, replicated on every rank) are not exchanged: each chunk's core gets the
values of the heads it attends, and their gradients are the rank's heads' only, which the dense
gradient reduction sums with the other ranks' heads like any replicated weight's.

Memory per rank: the local q/k/v/output `[B, N, heads, d]` (O(N)); one chunk's head-sharded
Q/K/V/output `[B, S, H/(D C), d]` (= N H d / C elements) and the kernel's statistics at a time,
never an `[S, S]` tensor. C = 1 is plain Ulysses: autograd saves the head-sharded tensors and
recomputes nothing. With C > 1 the chunks run inside one autograd node (`_HeadChunkedAttention`)
that saves only the local q, k, v; its backward re-exchanges each chunk's Q/K/V, recomputes the
chunk's attention with autograd, brings the chunk's output gradient over by the inverse exchange
and backpropagates, so the backward too holds one chunk at a time (one extra Q/K/V exchange and
attention forward per chunk). Under block activation checkpointing the block's recomputation
reuses the forward's output instead of running the chunks a third time
(`mop.parallel.checkpointing`).

Invariants: heads are independent in attention, so the result equals the single-device
computation up to floating-point summation order; every rank issues the same collectives in the
same order (forward, recomputation and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mop.config import Config, ConfigError
from mop.models.attention import AttentionCore
from mop.models.documents import Documents
from mop.models.families import model_spec
from mop.models.moe import RouterStats
from mop.models.transformer import MoETransformer
from mop.parallel.checkpointing import KeepsForwardOutputs, forward_autocast
from mop.parallel.comms import all_gather_rows, all_reduce_sum, all_to_all


@dataclass(frozen=True)
class ChunkPlan:
    """Head ranges `[start, stop)` that each destination rank receives for one head chunk, and the
    local KV head each of its query heads reads (`kv_index`), planned once on the host."""

    query: list[tuple[int, int]]
    kv: list[tuple[int, int]]
    kv_index: list[torch.Tensor | None]


def head_plan(heads: int, kv_heads: int, ranks: int, chunks: int) -> list[ChunkPlan]:
    """For each chunk: the query heads and the KV heads they read, per destination rank."""
    per_rank = heads // ranks
    per_chunk = per_rank // chunks
    group = heads // kv_heads
    plans = []
    for c in range(chunks):
        query = [(j * per_rank + c * per_chunk, j * per_rank + (c + 1) * per_chunk) for j in range(ranks)]
        kv = [(start // group, (stop - 1) // group + 1) for start, stop in query]
        plans.append(ChunkPlan(query, kv, [kv_index(q, k, group) for q, k in zip(query, kv)]))
    return plans


def kv_index(query: tuple[int, int], kv: tuple[int, int], group: int) -> torch.Tensor | None:
    """Local KV head read by each local query head, or None when SDPA's GQA broadcast expresses it."""
    index = torch.tensor([h // group - kv[0] for h in range(*query)])
    queries, kvs = query[1] - query[0], kv[1] - kv[0]
    if queries % kvs == 0 and torch.equal(index, torch.arange(kvs).repeat_interleave(queries // kvs)):
        return None
    return index


class SequenceDocumentBoundaries(nn.Module):
    """`MoETransformer.documents` for a sequence group: the `Documents` of whole sequences, from the
    ids (and branches' prefix lengths) of every rank's slice, all-gathered once per forward (not
    per layer or head chunk)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.ranks = dist.get_world_size(group)

    def forward(self, document_ids: torch.Tensor | None,
                prefix_lengths: torch.Tensor | None = None) -> Documents | None:
        if document_ids is None:
            return None
        rows = document_ids if prefix_lengths is None else torch.cat([document_ids, prefix_lengths.to(document_ids)])
        gathered = all_gather_rows(rows, self.group)  # [D*B', N], rank-major: one collective for both
        pieces, tokens = rows.shape
        full = gathered.view(self.ranks, pieces, tokens).permute(1, 0, 2).reshape(pieces, self.ranks * tokens)
        batch = document_ids.shape[0]
        return Documents.from_ids(full[:batch], full[batch:] if prefix_lengths is not None else None)


class UlyssesAttention(KeepsForwardOutputs, nn.Module):
    """Drop-in `Attention.core` for a sequence group; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup, heads: int, kv_heads: int, head_chunks: int,
                 core: AttentionCore | None = None):
        """`core`: the attention's own core (its scale), run on each chunk's whole sequences."""
        super().__init__()
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.plans = head_plan(heads, kv_heads, self.ranks, head_chunks)
        self.core = core or AttentionCore()

    def forward(self, q, k, v, documents: Documents | None, *per_head, shared_key=None):
        """`per_head`: tensors `[H]` with one value per query head that the inner core takes after the
        documents (gpt-oss's sinks); each chunk's core gets its heads' values. `shared_key`: a key
        part `[B, N, 1, r]` every head shares (latent attention's rotary key), sent once per rank and
        chunk instead of once per head."""
        if len(self.plans) == 1:
            (q_chunk,) = self.query_chunks(q)
            out = self.attend(self.plans[0], q_chunk, k, v, documents, per_head, shared_key)
            return self.to_sequence(out).flatten(2, 3)
        kept = self.kept_output()
        out = _HeadChunkedAttention.apply(q, k, v, self, documents, kept, shared_key, *per_head)
        self.keep_output(out)
        return out

    def query_chunks(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views `[D, B, N, heads per chunk, d]` of `q [B, N, H/.., d]`, one per chunk: destination
        rank j's query heads of the chunk; global head = j*H/D + c*H/(DC) + i."""
        chunks = len(self.plans)
        return q.unflatten(2, (self.ranks, chunks, -1)).permute(3, 2, 0, 1, 4, 5).unbind(0)

    def attend(self, plan: ChunkPlan, q_chunk, k, v, documents: Documents | None, per_head=(),
               shared_key=None) -> torch.Tensor:
        """Exchange one chunk's Q/K/V to head-sharded and attend: `[B, S, queries, d]` on this rank."""
        batch, tokens = k.shape[:2]
        shared = () if shared_key is None else (shared_key,)
        # v's head width may differ from q's and k's; a shared key part has its own
        dims = (q_chunk.shape[-1], k.shape[-1], v.shape[-1], *(t.shape[-1] for t in shared))
        # Send buffer, per destination rank: its query heads, then its K heads, then its V heads
        # (then the shared key part), each [B, N, heads, width]; filled in place, so the buffer is
        # the only copy.
        parts = [piece for j, (ka, kb) in enumerate(plan.kv)
                 for piece in (q_chunk[j], k[:, :, ka:kb], v[:, :, ka:kb], *shared)]
        sizes = [part.numel() for part in parts]
        send = k.new_empty(sum(sizes))
        offset = 0
        for part, size in zip(parts, sizes):
            send.narrow(0, offset, size).view(part.shape).copy_(part)
            offset += size
        each = len(dims)
        in_splits = [sum(sizes[each * j:each * j + each]) for j in range(self.ranks)]
        (qa, qb), (ka, kb) = plan.query[self.rank], plan.kv[self.rank]
        mine = [qb - qa, kb - ka, kb - ka, *(1 for _ in shared)]
        received = all_to_all(send, [in_splits[self.rank]] * self.ranks, in_splits, self.group)
        parts = received.view(self.ranks, -1).split([batch * tokens * h * d for h, d in zip(mine, dims)], 1)
        q_heads, k_heads, v_heads, *shared_heads = (
            part.reshape(self.ranks, batch, tokens, heads, dim).transpose(0, 1).reshape(batch, -1, heads, dim)
            for part, heads, dim in zip(parts, mine, dims))
        index = plan.kv_index[self.rank]
        if index is not None:
            index = index.to(k_heads.device, non_blocking=True)  # staged at once: no wait for the device
            k_heads, v_heads = k_heads.index_select(2, index), v_heads.index_select(2, index)
        shared_part = {"shared_key": shared_heads[0]} if shared_heads else {}
        return self.core(q_heads, k_heads, v_heads, documents, *(t[qa:qb] for t in per_head), **shared_part)

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """Head-sharded `[B, S, queries, d]` -> this rank's tokens of every rank's heads `[B, N, D, queries, d]`."""
        batch, seq, heads, dim = out.shape
        tokens = seq // self.ranks
        send = out.reshape(batch, self.ranks, tokens, heads, dim).transpose(0, 1).reshape(-1)
        splits = [send.numel() // self.ranks] * self.ranks
        returned = all_to_all(send, splits, splits, self.group)
        return returned.view(self.ranks, batch, tokens, heads, dim).permute(1, 2, 0, 3, 4)

    @torch.no_grad()
    def from_sequence(self, grad_chunk: torch.Tensor) -> torch.Tensor:
        """The inverse exchange of `to_sequence`, for an output gradient in `query_chunks` layout
        `[D, B, N, queries, d]` (no autograd): returns `[B, S, queries, d]`."""
        _, batch, tokens, heads, dim = grad_chunk.shape
        send = grad_chunk.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received.transpose(0, 1).reshape(batch, self.ranks * tokens, heads, dim)


class _HeadChunkedAttention(torch.autograd.Function):
    """Ulysses attention one head chunk at a time, saving only the local q, k, v.

    Forward: per chunk, exchange, attend and return (`kept`, the block checkpoint's copy of this
    output, skips all of it). Backward, per chunk: exchange the chunk's Q/K/V again and recompute
    its attention with autograd, bring the chunk's output gradient to head-sharded layout, and
    backpropagate through the attention and the exchange; q's gradient is written chunk by chunk,
    k's and v's (and the per-head values') accumulate over the chunks that read them.
    """

    @staticmethod
    def forward(ctx, q, k, v, ulysses: UlyssesAttention, documents, kept, shared_key, *per_head):
        ctx.ulysses, ctx.documents, ctx.autocast = ulysses, documents, forward_autocast(q.device)
        ctx.shared = shared_key is not None
        ctx.save_for_backward(q, k, v, *((shared_key,) if ctx.shared else ()), *per_head)
        if kept is not None:
            return kept
        batch, tokens, heads, _ = q.shape
        chunks = len(ulysses.plans)
        out = q.new_empty(batch, tokens, ulysses.ranks, chunks, heads // (ulysses.ranks * chunks), v.shape[-1])
        for c, (plan, q_chunk) in enumerate(zip(ulysses.plans, ulysses.query_chunks(q))):
            out[:, :, :, c] = ulysses.to_sequence(ulysses.attend(plan, q_chunk, k, v, documents, per_head, shared_key))
        return out.flatten(2, 4)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *rest = ctx.saved_tensors
        shared_leaf = rest.pop(0).detach().requires_grad_() if ctx.shared else None
        ulysses, documents = ctx.ulysses, ctx.documents
        grad_q = torch.empty_like(q)
        k_leaf, v_leaf = k.detach().requires_grad_(), v.detach().requires_grad_()
        head_leaves = [t.detach().requires_grad_(t.requires_grad) for t in rest]
        chunks = zip(ulysses.plans, *(ulysses.query_chunks(t) for t in (q, grad_out.contiguous(), grad_q)))
        for plan, q_chunk, grad_chunk, grad_q_chunk in chunks:
            q_leaf = q_chunk.detach().requires_grad_()
            with torch.enable_grad(), ctx.autocast():
                out_heads = ulysses.attend(plan, q_leaf, k_leaf, v_leaf, documents, head_leaves, shared_leaf)
            torch.autograd.backward(out_heads, ulysses.from_sequence(grad_chunk))
            grad_q_chunk.copy_(q_leaf.grad)
        shared_grad = None if shared_leaf is None else shared_leaf.grad
        return grad_q, k_leaf.grad, v_leaf.grad, None, None, None, shared_grad, *(t.grad for t in head_leaves)


def apply_sequence_parallel(model: MoETransformer, group: dist.ProcessGroup, head_chunks: int) -> None:
    """Swap every block's attention core for the Ulysses core over `group`."""
    heads = model_spec(model.cfg).attention
    model.documents = SequenceDocumentBoundaries(group)
    model.router_sums = SequenceRouterSums(group)
    model.response_sums = SequenceResponseSums(group)
    model.lookahead = SequenceLookahead(group)
    for block in model.layers:
        block.attention.core = UlyssesAttention(group, heads.heads, heads.kv_heads, head_chunks, block.attention.core)


class SequenceLookahead(nn.Module):
    """`MoETransformer.lookahead` for a sequence group (`mop.models.mtp`): the tokens after a slice's
    last are the next rank's first ones, all-gathered (the first `depth` of every slice's integer
    rows, once per forward); the group's last rank has none after it (-1)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, rows: torch.Tensor, depth: int) -> torch.Tensor:
        firsts = all_gather_rows(rows[..., :depth].reshape(-1, depth), self.group).view(self.ranks, *rows.shape[:-1],
                                                                                          depth)
        after = firsts[self.rank + 1] if self.rank + 1 < self.ranks else torch.full_like(firsts[0], -1)
        return torch.cat([rows, after], dim=-1)


class SequenceRouterSums(nn.Module):
    """`MoETransformer.router_sums` for a sequence group: each sequence's router sums summed over
    the ranks holding its slices (with gradient); each of the D ranks then holds them (`copies`)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.copies = dist.get_world_size(group)

    def forward(self, stats: RouterStats) -> RouterStats:
        return RouterStats(all_reduce_sum(stats.assignments, self.group), all_reduce_sum(stats.prob_sum, self.group),
                           all_reduce_sum(stats.rows, self.group))


class SequenceResponseSums(nn.Module):
    """`MoETransformer.response_sums` for a sequence group: each response's sums over the slices of
    its sequence, summed over the group (with gradient, one all-reduce per forward); each of the D
    ranks then holds them (`copies`), and the backward sums the D ranks' gradients back to every
    token, as for the router sums."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.copies = dist.get_world_size(group)

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(sums, self.group)


def check_settings(config: Config, world: int) -> None:
    """Ulysses' own settings: whole query heads per rank of a sequence group, in whole chunks, and
    sequences that split evenly over it."""
    p, heads = config.parallel, model_spec(config.model).attention.heads
    if config.data.seq_len % p.sequence:
        raise ConfigError("data.seq_len", f"{config.data.seq_len} is not divisible by parallel.sequence={p.sequence}")
    if heads % p.sequence:
        raise ConfigError("parallel.sequence", f"{p.sequence} does not divide model.heads={heads}; Ulysses gives "
                          "each rank of a sequence group whole heads")
    if (heads // p.sequence) % p.attention_head_chunks:
        raise ConfigError("parallel.attention_head_chunks", f"{p.attention_head_chunks} does not divide the "
                          f"{heads // p.sequence} heads per rank (model.heads / parallel.sequence)")
