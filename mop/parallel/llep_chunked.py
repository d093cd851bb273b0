"""Memory-efficient expert parallelism: the routed tokens in C chunks, pipelined, recomputed in backward.

The plan (EP or LLEP, `llep`) is made once per layer from the full loads; every routing segment
(a run of one source's rows of one expert for one computing rank, `llep_routing`) is then cut
into C consecutive parts and chunk c is the c-th part of every segment, so each chunk has the
same placement (same helpers, same shipped weights) and carries about 1/C of every rank's sent
and computed rows.

Forward, one autograd node for the whole expert computation of the layer:
- the shipped experts (index e of each of the kind's stacked tensors, `mop.models.moe.ExpertKind`)
  move once (p2p, overlapped with the first token exchange);
- chunk c: its token rows are gathered from the input and dispatched by an async all-to-all,
  chunk c+1's dispatch is started before chunk c's experts run, chunk c's outputs go back by an
  async combine all-to-all that runs while chunk c+1 computes, and are then weighted and summed
  into the output (in chunk order). Only about two chunks' buffers and one chunk's expert
  intermediate exist at a time; nothing per chunk is saved.
Backward, per chunk, pipelined the same way (chunk c+1's rows travel and chunk c-1's results come
back while chunk c computes): the source sends [token rows | their output gradients g | routing
weights w] in one all-to-all; the computing rank recomputes the gate and up projections only and
takes the experts' gradients for the output gradients w * g from the per-row product
`<g, expert output>` computed without the down projection's forward (the kind's compute with a
probe: `<g W_down, hidden>` for the SwiGLU experts, `swiglu_experts`; plus `<g, d_e>` for
gpt_oss's down bias), which is also the routing weight's gradient: the chunked layer recomputes two
thirds of the expert forward's FLOPs (the gate and up GEMM), not all of it. It returns [row
gradients | routing-weight gradients] in one all-to-all. The foreign experts' gradients (every
stacked tensor's) accumulate over the chunks and return to their owners once, at the end, as in
the unchunked path.
In a checkpointed block's recomputation (`replaying`) the node only ships the foreign weights again
(its backward needs them) and returns a zero-stride placeholder of the output's shape, so the
expert forward runs once and its gate and up projections once more in the backward, checkpointed
or not (`mop.parallel.checkpointing`). The placeholder is exact because in the recomputation the
output only feeds additions (the shared expert's, the residual), which save nothing: keeping the
real output until the backward would cost [tokens, H] per block (4 KB per token of an fp32
anchor-sized model's 4 blocks), the largest thing a checkpointed block keeps after its input.

Invariant: the same rows meet the same weights as in `ExpertParallel`, only in C groups, so the
result matches it (and the single-device layer) up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mop.parallel.checkpointing import forward_autocast
from mop.parallel.comms import wait_for
from mop.parallel.llep_plan import Plan
from mop.parallel.llep_routing import (
    Exchange,
    Routing,
    Segment,
    expert_outputs,
    finish_gradient_return,
    grouped_expert_outputs,
    routing_from_segments,
    source_segments,
    start_gradient_return,
    start_weight_shipping,
)


def chunk_segments(per_source: list[list[Segment]], chunks: int) -> list[list[list[Segment]]]:
    """The layer's segments (`source_segments`) in `chunks` parts: chunk c holds the c-th of
    `chunks` consecutive parts of every segment (a run of one source's rows of one expert for one
    computing rank). So every chunk has the layer's placement and carries about 1/chunks of what
    each rank sends and computes; cutting the plan's slices instead would put a source's rows of
    an expert, consecutive in the expert's global numbering, into one or two chunks when Ep >= chunks."""
    parts: list[list[list[Segment]]] = [[[] for _ in per_source] for _ in range(chunks)]
    for source, segments in enumerate(per_source):
        for destination, expert, first, rows in segments:
            for c in range(chunks):
                lo, hi = rows * c // chunks, rows * (c + 1) // chunks
                if hi > lo:
                    parts[c][source].append((destination, expert, first + lo, hi - lo))
    return parts


@dataclass
class ChunkJob:
    """Everything one layer's chunked dispatch needs: per chunk, its rows and routing; once, the weights."""

    assignments: list[torch.Tensor]  # per chunk: flat assignment ids (token * k + j) in send order
    routings: list[Routing]
    exchange: Exchange  # the layer's weight transfers and groups (token splits unused)
    top_k: int


def chunk_job(plan: Plan, chunks: int, counts: list[list[int]], rank: int, order: torch.Tensor,
              exchange: Exchange, top_k: int) -> ChunkJob:
    routings, assignments = [], []
    shipped = [expert for expert, _ in exchange.receive]  # the foreign weights every chunk computes with
    for segments in chunk_segments(source_segments(plan, counts), chunks):
        routing = routing_from_segments(segments, plan.experts, rank, shipped, device=order.device)
        routings.append(routing)
        assignments.append(order[routing.send_rows])
    return ChunkJob(assignments, routings, exchange, top_k)


def _exchange_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group, async_op=False):
    out = rows.new_empty((sum(out_splits), rows.shape[1]))
    work = dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return out, work


class ChunkedExperts(torch.autograd.Function):
    """The whole chunked expert computation of a layer as one node; the experts' gradients are added
    to the owned parameters' `.grad` directly (`add_to_grad`), chunk by chunk. `owned`: the owned
    partition's stacked tensors; `compute`: their kind's function (`ExpertKind`)."""

    @staticmethod
    def forward(ctx, x, weights_flat, owned: tuple[torch.Tensor, ...], compute, job: ChunkJob, replaying: bool):
        ex = job.exchange
        ctx.job, ctx.owned, ctx.compute, ctx.autocast = job, owned, compute, forward_autocast(x.device)
        foreign, weight_works = start_weight_shipping(owned, ex)
        if replaying:  # a checkpointed block's recomputation: the backward needs the shipped weights only
            wait_for(weight_works)
            ctx.save_for_backward(x, weights_flat, *foreign)
            return x.new_zeros(()).expand_as(x)
        out = torch.zeros_like(x)
        pending = _dispatch(x, job, 0)
        wait_for(weight_works)
        detached = tuple(w.detach() for w in owned)
        combining = None  # chunk c-1's combine, in flight while chunk c computes
        for c, routing in enumerate(job.routings):
            received, work = pending
            wait_for([work])
            # they hold chunk c's sent rows: gone before chunk c+1's are gathered
            pending = work = None
            if c + 1 < len(job.routings):
                pending = _dispatch(x, job, c + 1)
            y = expert_outputs(received, routing, compute, detached, tuple(foreign))
            del received
            if combining is not None:
                _add_combined(out, weights_flat, job, *combining)
                combining = None
            combining = (c, y, *_exchange_rows(y, routing.send_splits, routing.recv_splits, ex.group, async_op=True))
        _add_combined(out, weights_flat, job, *combining)
        ctx.save_for_backward(x, weights_flat, *foreign)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weights_flat, *foreign = ctx.saved_tensors
        job, ex, owned, n = ctx.job, ctx.job.exchange, ctx.owned, len(ctx.owned)
        hidden = x.shape[1]
        trains = [param.requires_grad for param in owned] * 2  # a frozen base has no gradient
        for param in owned:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        # Leaves sharing the weights, whose .grad is the owned gradient buffer (or the foreign
        # accumulator): each chunk's weight gradients are added there in place, one GEMM at a time.
        leaves = [w.detach().requires_grad_(train) for w, train in zip((*owned, *foreign), trains)]
        for i, (leaf, param) in enumerate(zip(leaves, (*owned, *foreign))):
            if leaf.requires_grad:
                leaf.grad = param.grad if i < n else torch.zeros_like(param)
        grad_x, grad_weights = torch.zeros_like(x), torch.zeros_like(weights_flat)

        def send_rows(c: int):
            """Start chunk c's [token rows | output gradients | routing weights] exchange to the computing ranks."""
            tokens = job.assignments[c] // job.top_k
            # The weight repeated over 16 bytes, so the received rows' views keep the 16-byte
            # strides the grouped GEMM needs.
            weight = weights_flat[job.assignments[c]].unsqueeze(-1).to(grad_out.dtype)
            weight = weight.expand(-1, 16 // weight.element_size())
            routing = job.routings[c]
            return _exchange_rows(torch.cat([x[tokens], grad_out[tokens], weight], dim=1), routing.recv_splits,
                                  routing.send_splits, ex.group, async_op=True)

        def take_back(c: int, sent: torch.Tensor, back: torch.Tensor, work) -> None:
            wait_for([work])
            tokens = job.assignments[c] // job.top_k
            grad_x.index_add_(0, tokens, back[:, :hidden])
            grad_weights[job.assignments[c]] = back[:, hidden].to(grad_weights.dtype)

        # Pipelined like the forward: chunk c+1's rows travel and chunk c-1's results come back
        # while chunk c's experts are recomputed and differentiated.
        incoming, returning = send_rows(0), None
        for c, routing in enumerate(job.routings):
            received, work = incoming
            wait_for([work])
            incoming = work = None  # as in the forward
            if c + 1 < len(job.routings):
                incoming = send_rows(c + 1)
            # The received rows grouped by expert, in one gather that replaces the received buffer.
            grouped = received[routing.compute_rows]
            del received
            rows = grouped[:, :hidden].detach().requires_grad_()
            used = [rows] + [leaf for leaf in (leaves[:n] if sum(routing.native_counts) else []) + (
                leaves[n:] if sum(routing.foreign_counts) else []) if leaf.requires_grad]
            with torch.enable_grad(), ctx.autocast():
                # Per row <g, expert(x)> (the routing weight's gradient), without the down
                # projection's forward; its backward for the weights w is the experts' backward
                # for output gradients w * g (`ExpertKind.compute`).
                products = grouped_expert_outputs(rows, routing, ctx.compute, tuple(leaves[:n]), tuple(leaves[n:]),
                                                  probe=grouped[:, hidden:2 * hidden])
                torch.autograd.backward(products, grouped[:, 2 * hidden].float(), inputs=used)
            # [row gradients | products] back in arrival order, as the sources sent the rows.
            sent = rows.grad.new_empty((rows.shape[0], hidden + 1))
            sent[:, :hidden].index_copy_(0, routing.compute_rows, rows.grad)
            sent[:, hidden].index_copy_(0, routing.compute_rows, products.detach().to(sent.dtype))
            del grouped, rows, products
            if returning is not None:
                take_back(*returning)
                returning = None
            returning = (c, sent, *_exchange_rows(sent, routing.send_splits, routing.recv_splits, ex.group,
                                                  async_op=True))
        take_back(*returning)
        returned, works = start_gradient_return([leaf.grad for leaf in leaves[n:] if leaf.requires_grad], owned, ex)
        finish_gradient_return(owned, ex, returned, works)
        return grad_x, grad_weights, None, None, None, None


def _add_combined(out: torch.Tensor, weights_flat: torch.Tensor, job: ChunkJob, c: int, sent: torch.Tensor,
                  back: torch.Tensor, work) -> None:
    """Wait for chunk c's combine (`sent` stays referenced until then) and add its weighted rows."""
    wait_for([work])
    assignment = job.assignments[c]
    out.index_add_(0, assignment // job.top_k, back * weights_flat[assignment].unsqueeze(-1).to(back.dtype))


def _dispatch(x: torch.Tensor, job: ChunkJob, c: int):
    routing = job.routings[c]
    return _exchange_rows(x[job.assignments[c] // job.top_k], routing.recv_splits, routing.send_splits,
                          job.exchange.group, async_op=True)
