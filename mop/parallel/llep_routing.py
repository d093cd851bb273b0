"""Routing tables of expert parallelism: which rows go where, the transfers that move them, and the
expert step on the received rows; shared by the plain (`llep`) and chunked (`llep_chunked`) paths.

Tokens of expert e are numbered globally in (source rank, local expert-sorted order). A plan
slice `[start, stop)` of that numbering (`llep_plan`) names the rank that computes those rows, so
every rank derives, from the plan and the all-gathered `[Ep, E]` count matrix alone, what it
sends to each rank, what it receives from each, and how the received rows group by expert.
Everything is derived per segment (a run of rows of one expert from one source to one rank:
O(Ep x (E + plan slices)) host integers, never one per token); the two row permutations are then
expanded on the device from the segments' starts and lengths (`row_ranges`: `repeat_interleave` +
`arange`, no host synchronisation), so the host does no per-token work.
Owners and helpers enumerate weight transfers in the plan's sorted order, so point-to-point
messages between two ranks pair up without any handshake. A transfer moves one expert: index e
of each of the experts' stacked tensors (their `ExpertKind`, `mop.models.moe`: SwiGLU's
`(w_gate_up, w_down)`, gpt_oss's two weights and two biases), one message per tensor, in the
kind's order; its gradients return the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mop.models.projections import device_ints, row_ranges
from mop.parallel.comms import wait_for
from mop.parallel.llep_plan import Plan


@dataclass
class Routing:
    """Where this rank's rows go and how the rows it receives are grouped for the GEMMs."""

    send_rows: torch.Tensor  # positions in this rank's expert-sorted assignments, grouped by destination
    send_splits: list[int]
    recv_splits: list[int]
    compute_rows: torch.Tensor  # positions in the received rows: owned experts ascending, then foreign ones
    native_counts: list[int]  # rows per owned expert (all E/Ep of them, zeros included)
    foreign_experts: list[int]  # shipped experts this rank computes, ascending
    foreign_counts: list[int]


Segment = tuple[int, int, int, int]  # (destination rank, expert, first local position, rows)


def _segments(plan: Plan, counts: list[int], before: list[int]) -> list[Segment]:
    """(destination, expert, first local position, rows) of one source rank, in its local sorted order.

    `counts[e]`: the source's rows for e; `before[e]`: rows of e on lower source ranks (its offset
    in e's global numbering).
    """
    segments, position = [], 0
    for expert, rows in enumerate(counts):
        for piece in plan.slices_of(expert):
            lo, hi = max(piece.start, before[expert]), min(piece.stop, before[expert] + rows)
            if hi > lo:
                segments.append((piece.rank, expert, position + lo - before[expert], hi - lo))
        position += rows
    return segments


def source_segments(plan: Plan, counts: list[list[int]]) -> list[list[Segment]]:
    """Every source rank's segments under `plan`, given the `[Ep, E]` count matrix (`_segments`)."""
    before, per_source = [0] * len(counts[0]), []
    for source_counts in counts:
        per_source.append(_segments(plan, source_counts, before))
        before = [b + c for b, c in zip(before, source_counts)]
    return per_source


def build_routing(plan: Plan, counts: list[list[int]], rank: int, foreign: list[int] | None = None,
                  device: torch.device | str = "cpu") -> Routing:
    """The routing of group rank `rank` from the plan and the `[Ep, E]` count matrix; the row
    permutations as `device` tensors."""
    return routing_from_segments(source_segments(plan, counts), plan.experts, rank, foreign, device)


def routing_from_segments(per_source: list[list[Segment]], experts: int, rank: int, foreign: list[int] | None = None,
                          device: torch.device | str = "cpu") -> Routing:
    """The routing of group rank `rank` from every source's segments (`source_segments`, or a chunk's).

    `foreign`: the shipped experts whose weights this rank holds, in that order (default: those
    the plan sends it rows of, ascending). A chunk of a chunked layer passes the whole layer's, so
    its foreign counts line up with the shipped weights even where the chunk has no rows for some.
    """
    ranks = len(per_source)
    mine = per_source[rank]
    sent = [seg for destination in range(ranks) for seg in mine if seg[0] == destination]
    send_splits = [sum(rows for dest, _, _, rows in mine if dest == destination) for destination in range(ranks)]
    # Received rows arrive source by source, each source's segments in its local order.
    arriving = [(expert, rows) for s in range(ranks) for dest, expert, _, rows in per_source[s] if dest == rank]
    recv_splits = [sum(rows for dest, _, _, rows in per_source[s] if dest == rank) for s in range(ranks)]
    per_rank = experts // ranks
    owned = list(range(rank * per_rank, (rank + 1) * per_rank))
    received_foreign = sorted({expert for expert, _ in arriving} - set(owned))
    if foreign is None:
        foreign = received_foreign
    elif not set(received_foreign) <= set(foreign):
        raise ValueError(f"rank {rank} receives rows of experts {received_foreign} but holds weights of {foreign}")
    group = {expert: index for index, expert in enumerate([*owned, *foreign])}
    starts = [0]
    for _, rows in arriving:
        starts.append(starts[-1] + rows)
    # Received segments grouped by expert (owned ascending, then foreign), in arrival order within one.
    grouped = sorted(range(len(arriving)), key=lambda i: (group[arriving[i][0]], i))
    rows_of = [0] * len(group)
    for expert, rows in arriving:
        rows_of[group[expert]] += rows
    return Routing(row_ranges([first for _, _, first, _ in sent], [rows for *_, rows in sent], device),
                   send_splits, recv_splits,
                   row_ranges([starts[i] for i in grouped], [arriving[i][1] for i in grouped], device),
                   rows_of[:len(owned)], foreign, rows_of[len(owned):])


@dataclass
class Exchange:
    """The collectives of one dispatch: token splits and the weight transfers of the plan."""

    send_splits: list[int]
    recv_splits: list[int]
    group: dist.ProcessGroup
    p2p_group: dist.ProcessGroup
    ship: list[tuple[int, int]] = field(default_factory=list)  # (owned local expert index, helper group rank)
    receive: list[tuple[int, int]] = field(default_factory=list)  # (expert, owner group rank)


def point_to_point(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group):
    """Start `(tensor, group rank)` sends and receives on `group`; returns the works to wait on.

    Owner and helper enumerate the plan's transfers in the same sorted order, so the k-th message
    between two ranks is the same tensor on both sides.
    """
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def add_to_grad(param: torch.Tensor, index: torch.Tensor | None, grad: torch.Tensor) -> None:
    """Accumulate `grad` into rows `index` of `param.grad` (all rows when `index` is None), in place.

    Gradients that reach an expert weight outside its own GEMM (returned by helpers, or computed
    chunk by chunk) are added straight into the parameter's gradient buffer rather than returned
    through autograd, which would first materialise a zero-padded full-size copy of the partition's
    gradient and then a second one for the sum. This runs inside the layer's backward, before the
    layer's FSDP2 post-backward reduces the partition's gradient.
    """
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    if index is None:
        param.grad += grad
    else:
        param.grad.index_add_(0, index, grad.to(param.grad.dtype))


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What a message carries of `t`: its bytes for one-byte formats (fp8, MXFP4's codes), which not
    every backend sends as such; the tensor itself otherwise."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def start_weight_shipping(owned: tuple[torch.Tensor, ...], exchange: Exchange):
    """Owner -> helper: start moving the shipped experts' stacked tensors (each of `owned`, in order;
    a frozen base's too, in its stored format); returns (foreign tensors, one per owned one, works)."""
    foreign = [w.new_empty((len(exchange.receive), *w.shape[1:])) for w in owned]
    works = point_to_point([(_wire(w.detach()[local]), helper) for local, helper in exchange.ship for w in owned],
                           [(_wire(w[i]), owner) for i, (_, owner) in enumerate(exchange.receive) for w in foreign],
                           exchange.p2p_group)
    return foreign, works


def start_gradient_return(foreign_grads: list[torch.Tensor], owned: tuple[torch.Tensor, ...],
                          exchange: Exchange):
    """Helper -> owner: start returning the foreign experts' gradients, those of the owned tensors that
    train (`foreign_grads`: one per such tensor, in order); returns (buffers, works)."""
    returned = [w.new_empty((len(exchange.ship), *w.shape[1:])) for w in owned if w.requires_grad]
    works = point_to_point([(g[i], owner) for i, (_, owner) in enumerate(exchange.receive) for g in foreign_grads],
                           [(g[j], helper) for j, (_, helper) in enumerate(exchange.ship) for g in returned],
                           exchange.p2p_group)
    return returned, works


def finish_gradient_return(owned: tuple[torch.Tensor, ...], exchange: Exchange, returned, works) -> None:
    """Wait for the returned gradients and add them to the gradients of the owned tensors that train."""
    wait_for(works)
    if exchange.ship and returned:
        local = device_ints([index for index, _ in exchange.ship], returned[0].device)
        for param, grad in zip([w for w in owned if w.requires_grad], returned):
            add_to_grad(param, local, grad)


def expert_outputs(received: torch.Tensor, routing: Routing, compute, owned: tuple[torch.Tensor, ...],
                   foreign: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Expert outputs of the received rows, in arrival order (as the combine sends them back).

    `compute`: the experts' `ExpertKind.compute`; `owned`, `foreign`: the owned partition's and
    the shipped experts' stacked tensors, in the kind's order.
    """
    compute_rows = routing.compute_rows
    y = grouped_expert_outputs(received[compute_rows], routing, compute, owned, foreign)
    # Arrival position compute_rows[i] holds y[i].
    return y[torch.argsort(compute_rows)]


def grouped_expert_outputs(rows: torch.Tensor, routing: Routing, compute, owned: tuple[torch.Tensor, ...],
                           foreign: tuple[torch.Tensor, ...], probe: torch.Tensor | None = None):
    """Expert outputs of rows already in compute order (`rows = received[routing.compute_rows]`):
    owned experts first, then foreign ones, one `compute` call (grouped GEMMs) each. With `probe`
    (one row per row), each row's `<probe, output>` instead (`ExpertKind.compute`)."""
    native = sum(routing.native_counts)
    y = compute(rows[:native], routing.native_counts, owned, probe=None if probe is None else probe[:native])
    if sum(routing.foreign_counts):
        y = torch.cat([y, compute(rows[native:], routing.foreign_counts, foreign,
                                  probe=None if probe is None else probe[native:])])
    return y
