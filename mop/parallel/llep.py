"""Expert parallelism over an expert group: standard EP and least-loaded EP (LLEP).

Layout. The E experts are partitioned contiguously over the Ep ranks of an expert group: the rank
at position p of its group owns experts `[p*E/Ep, (p+1)*E/Ep)` (`mop.parallel.experts` shards
that partition over its expert-replica group with FSDP2). Every rank routes its own tokens.

Phases of one forward (one MoE layer):
1. counts: each rank sorts its token-expert assignments by expert and all-gathers its per-expert
   counts over the group, so every rank knows the `[Ep, E]` count matrix (its column sums are the
   all-reduced expert loads).
2. plan: every rank computes the same plan from the loads (`llep_plan`): "ep" keeps each expert
   on its owner; "llep" spills an overloaded owner's tokens to the least-loaded ranks. Tokens of
   expert e are numbered globally in (source rank, local order); a plan slice `[start, stop)` of
   that numbering says which rank computes them, so send and receive sizes follow from the count
   matrix alone (`build_routing`).
3. dispatch: one uneven all-to-all moves each assignment's token row to the rank computing it;
   the expert weights a helper needs travel owner -> helper by `batch_isend_irecv` on the
   separate p2p group, issued before the token all-to-all and waited after it (overlap).
4. compute: the owned experts in one grouped GEMM over the local partition, the shipped foreign
   experts in another.
5. combine: the inverse all-to-all returns each output row to its source, which weights it by
   the router probability and sums the k rows of each token.
Backward mirrors it: the combine's inverse, the experts' backward, then (in the dispatch's
backward, so every rank does it at the same point) the token gradients go back by the inverse
all-to-all while each helper returns its foreign weights' gradients to their owner, which adds
them to its own before FSDP2 reduces the partition's gradient.

Invariants: the expert computation per assignment row is the single-device one, only placed
elsewhere; every rank issues the same collectives in the same order, including ranks that route
or compute no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mop.models.moe import Experts, expert_order, swiglu_experts
from mop.parallel.comms import all_gather_rows, all_to_all
from mop.parallel.llep_plan import Plan, imbalance, plan_ep, plan_llep
from mop.parallel.mesh import DistLayout


@dataclass(frozen=True)
class BalanceOptions:
    """How tokens are placed over the expert group (the `parallel.llep_*` settings)."""

    mode: str = "ep"
    gate: float = 1.3
    alpha: float = 1.0
    min_chunk: int = 1024

    def plan(self, loads: list[int], ranks: int) -> Plan:
        if self.mode == "llep":
            return plan_llep(loads, ranks, gate=self.gate, alpha=self.alpha, min_chunk=self.min_chunk)
        return plan_ep(loads, ranks)


@dataclass
class Routing:
    """Where this rank's rows go and how the rows it receives are grouped for the GEMMs."""

    send_rows: list[int]  # positions in this rank's expert-sorted assignments, grouped by destination
    send_splits: list[int]
    recv_splits: list[int]
    compute_rows: list[int]  # positions in the received rows: owned experts ascending, then foreign ones
    native_counts: list[int]  # rows per owned expert (all E/Ep of them, zeros included)
    foreign_experts: list[int]  # shipped experts this rank computes, ascending
    foreign_counts: list[int]


def _segments(plan: Plan, counts: list[int], before: list[int]) -> list[tuple[int, int, int, int]]:
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


def build_routing(plan: Plan, counts: list[list[int]], rank: int) -> Routing:
    """The routing of group rank `rank` from the plan and the `[Ep, E]` count matrix."""
    ranks, experts = len(counts), len(counts[0])
    before = [[sum(counts[s][e] for s in range(source)) for e in range(experts)] for source in range(ranks)]
    per_source = [_segments(plan, counts[s], before[s]) for s in range(ranks)]
    mine = per_source[rank]
    send_rows, send_splits = [], []
    for destination in range(ranks):
        chosen = [seg for seg in mine if seg[0] == destination]
        send_rows += [p for _, _, first, rows in chosen for p in range(first, first + rows)]
        send_splits.append(sum(seg[3] for seg in chosen))
    # Received rows arrive source by source, each source's segments in its local order.
    arriving = [(expert, rows) for s in range(ranks) for dest, expert, _, rows in per_source[s] if dest == rank]
    recv_splits = [sum(rows for dest, _, _, rows in per_source[s] if dest == rank) for s in range(ranks)]
    by_expert: dict[int, list[int]] = {}
    position = 0
    for expert, rows in arriving:
        by_expert.setdefault(expert, []).extend(range(position, position + rows))
        position += rows
    per_rank = experts // ranks
    owned = range(rank * per_rank, (rank + 1) * per_rank)
    foreign = sorted(e for e in by_expert if e not in owned)
    compute_rows = [p for e in [*owned, *foreign] for p in by_expert.get(e, [])]
    return Routing(send_rows, send_splits, recv_splits, compute_rows, [len(by_expert.get(e, [])) for e in owned],
                   foreign, [len(by_expert[e]) for e in foreign])


@dataclass
class Exchange:
    """The collectives of one dispatch: token splits and the weight transfers of the plan."""

    send_splits: list[int]
    recv_splits: list[int]
    group: dist.ProcessGroup
    p2p_group: dist.ProcessGroup
    ship: list[tuple[int, int]] = field(default_factory=list)  # (owned local expert index, helper group rank)
    receive: list[tuple[int, int]] = field(default_factory=list)  # (expert, owner group rank)


def _point_to_point(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group):
    """Start `(tensor, group rank)` sends and receives on `group`; returns the works to wait on.

    Owner and helper enumerate the plan's transfers in the same sorted order, so the k-th message
    between two ranks is the same tensor on both sides.
    """
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


class _Dispatch(torch.autograd.Function):
    """Token all-to-all plus weight shipping in forward; their inverses together in backward."""

    @staticmethod
    def forward(ctx, x_send, w_gate_up, w_down, exchange: Exchange):
        ctx.exchange = exchange
        foreign = [w.new_empty((len(exchange.receive), *w.shape[1:])) for w in (w_gate_up, w_down)]
        owned = (w_gate_up.detach(), w_down.detach())
        works = _point_to_point([(w[local], helper) for local, helper in exchange.ship for w in owned],
                                [(w[i], owner) for i, (_, owner) in enumerate(exchange.receive) for w in foreign],
                                exchange.p2p_group)
        received = x_send.new_empty((sum(exchange.recv_splits), x_send.shape[1]))
        dist.all_to_all_single(received, x_send.contiguous(), exchange.recv_splits, exchange.send_splits,
                               group=exchange.group)
        for work in works:
            work.wait()
        ctx.weight_shapes = (w_gate_up.shape, w_down.shape)
        return received, *foreign

    @staticmethod
    def backward(ctx, grad_received, grad_foreign_gate_up, grad_foreign_down):
        exchange = ctx.exchange
        returned = [grad_received.new_empty((len(exchange.ship), *shape[1:])) for shape in ctx.weight_shapes]
        foreign_grads = [g if g is not None else grad_received.new_zeros((len(exchange.receive), *shape[1:]))
                         for g, shape in zip((grad_foreign_gate_up, grad_foreign_down), ctx.weight_shapes)]
        works = _point_to_point([(g[i], owner) for i, (_, owner) in enumerate(exchange.receive) for g in foreign_grads],
                                [(g[j], helper) for j, (_, helper) in enumerate(exchange.ship) for g in returned],
                                exchange.p2p_group)
        grad_x = grad_received.new_empty((sum(exchange.send_splits), grad_received.shape[1]))
        dist.all_to_all_single(grad_x, grad_received.contiguous(), exchange.send_splits, exchange.recv_splits,
                               group=exchange.group)
        for work in works:
            work.wait()
        grad_weights = [None, None]
        if exchange.ship:
            local = torch.tensor([index for index, _ in exchange.ship], device=grad_received.device)
            grad_weights = [grad_received.new_zeros(shape).index_add_(0, local, g)
                            for shape, g in zip(ctx.weight_shapes, returned)]
        return grad_x, *grad_weights, None


class ExpertParallel(nn.Module):
    """Drop-in `Experts` for one rank of an expert group; see the module docstring."""

    def __init__(self, experts: Experts, layout: DistLayout, options: BalanceOptions):
        super().__init__()
        self.ranks = layout.layout.expert
        self.rank = layout.layout.expert_partition(layout.rank)
        self.num_experts = experts.num_experts
        self.per_rank = self.num_experts // self.ranks
        owned = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.w_gate_up = nn.Parameter(experts.w_gate_up.detach()[owned].clone())
        self.w_down = nn.Parameter(experts.w_down.detach()[owned].clone())
        self.group, self.p2p_group = layout.expert_group, layout.expert_p2p_group
        self.options = options
        self.records: list[dict] = []

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids.shape[-1]
        order, counts = expert_order(expert_ids, self.num_experts)
        count_matrix = all_gather_rows(counts.unsqueeze(0), self.group).tolist()
        loads = [sum(column) for column in zip(*count_matrix)]
        plan = self.options.plan(loads, self.ranks)
        routing = build_routing(plan, count_matrix, self.rank)
        assignment = order[torch.tensor(routing.send_rows, dtype=torch.long, device=x.device)]
        exchange = self._exchange(plan, routing)
        received, foreign_gate_up, foreign_down = _Dispatch.apply(
            x[assignment // top_k], self.w_gate_up, self.w_down, exchange)
        y = self._compute(received, routing, foreign_gate_up, foreign_down)
        back = all_to_all(y, exchange.send_splits, exchange.recv_splits, self.group)
        y = back * weights.reshape(-1)[assignment].unsqueeze(-1).to(back.dtype)
        self._record(plan, loads, x)
        return torch.zeros_like(x).index_add_(0, assignment // top_k, y.to(x.dtype))

    def _exchange(self, plan: Plan, routing: Routing) -> Exchange:
        transfers = plan.transfers()
        ship = [(expert - self.rank * self.per_rank, helper) for expert, owner, helper in transfers if owner == self.rank]
        receive = [(expert, owner) for expert, owner, helper in transfers if helper == self.rank]
        return Exchange(routing.send_splits, routing.recv_splits, self.group, self.p2p_group, ship, receive)

    def _compute(self, received, routing: Routing, foreign_gate_up, foreign_down):
        rows = received[torch.tensor(routing.compute_rows, dtype=torch.long, device=received.device)]
        native = sum(routing.native_counts)
        y = swiglu_experts(rows[:native], routing.native_counts, self.w_gate_up, self.w_down)
        if routing.foreign_experts:
            y = torch.cat([y, swiglu_experts(rows[native:], routing.foreign_counts, foreign_gate_up, foreign_down)])
        # Back to arrival order for the combine: arrival position compute_rows[i] holds y[i].
        return y[torch.argsort(torch.tensor(routing.compute_rows, dtype=torch.long, device=y.device))]

    def _record(self, plan: Plan, loads: list[int], x: torch.Tensor) -> None:
        native = plan_ep(loads, self.ranks).rank_loads()
        after = plan.rank_loads()
        element = x.element_size()
        weight_bytes = (self.w_gate_up[0].numel() + self.w_down[0].numel()) * element
        self.records.append({
            "expert_load_imbalance": imbalance(loads),
            "rank_load_imbalance_before": imbalance(native),
            "rank_load_imbalance_after": imbalance(after),
            "tokens_moved": sum(s.stop - s.start for s in plan.slices if s.rank != plan.native(s.expert)),
            "weight_bytes_moved": len(plan.transfers()) * weight_bytes,
            "llep_active": not plan.balanced,
        })


def apply_expert_parallel(model, layout: DistLayout, options: BalanceOptions) -> None:
    """Swap every MoE layer's `Experts` for its expert-parallel counterpart on this rank."""
    for block in model.layers:
        if block.is_moe:
            block.mlp.experts = ExpertParallel(block.mlp.experts, layout, options)


def drain_records(model) -> list[dict]:
    """The per-forward routing records of every expert-parallel layer since the last call."""
    records = []
    for module in model.modules():
        if isinstance(module, ExpertParallel):
            records += module.records
            module.records = []
    return records
