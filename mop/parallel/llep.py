"""Expert parallelism over an expert group: standard EP and least-loaded EP (LLEP).

Layout. The E experts are partitioned contiguously over the Ep ranks of an expert group: the rank
at position p of its group owns experts `[p*E/Ep, (p+1)*E/Ep)` (`mop.parallel.experts` shards
that partition over its expert-replica group with FSDP2). Every rank routes its own tokens.
The experts are whatever the family's experts module is, through its `ExpertKind`
(`mop.models.moe`): an ordered tuple of stacked tensors with the expert on dim 0 (the shared
SwiGLU's `w_gate_up, w_down`; gpt_oss's `gate_up_weight, gate_up_bias, down_weight, down_bias`),
each partitioned alike and kept under its own name (so checkpoints, placement and the global views
see the unwrapped model's names), and the function that computes experts on rows sorted by expert.

Phases of one forward (one MoE layer):
1. counts: each rank sorts its token-expert assignments by expert (on the device) and all-gathers
   its per-expert counts over the group, so every rank knows the `[Ep, E]` count matrix (its
   column sums are the all-reduced expert loads): the layer pass's only device-to-host copy.
2. plan: every rank computes the same plan from the loads (`llep_plan`): "ep" keeps each expert
   on its owner; "llep" spills an overloaded owner's tokens to the least-loaded ranks. Tokens of
   expert e are numbered globally in (source rank, local order); a plan slice `[start, stop)` of
   that numbering says which rank computes them, so send and receive sizes follow from the count
   matrix alone (`build_routing`, per segment on the host, the row permutations expanded on the
   device). A checkpointed block's recomputation reuses the forward's route (`LayerRoute`).
3. dispatch: one uneven all-to-all moves each assignment's token row to the rank computing it;
   the experts a helper needs (index e of each stacked tensor) travel owner -> helper by
   `batch_isend_irecv` on the separate p2p group, issued before the token all-to-all and waited
   after it (overlap).
4. compute: the kind's function on the owned experts' rows (one grouped GEMM per projection over
   the local partition), then on the shipped foreign experts' rows.
5. combine: the inverse all-to-all returns each output row to its source, which weights it by
   the router probability and sums the k rows of each token.
Backward mirrors it: the combine's inverse, the experts' backward, then (in the dispatch's
backward, so every rank does it at the same point) the token gradients go back by the inverse
all-to-all while each helper returns its foreign experts' gradients to their owner, which adds
them to its own before FSDP2 reduces the partition's gradient.

Invariants: the expert computation per assignment row is the single-device one, only placed
elsewhere; every rank issues the same collectives in the same order, including ranks that route
or compute no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mop.config import Config, ConfigError
from mop.models.moe import expert_order
from mop.models.projections import device_ints
from mop.parallel.checkpointing import KeepsForwardOutputs
from mop.parallel.comms import all_gather_rows, all_to_all, wait_for
from mop.parallel.llep_chunked import ChunkedExperts, ChunkJob, chunk_job
from mop.parallel.llep_plan import Plan, imbalance, plan_ep, plan_llep
from mop.parallel.llep_routing import (
    Exchange,
    Routing,
    build_routing,
    expert_outputs,
    finish_gradient_return,
    start_gradient_return,
    start_weight_shipping,
)
from mop.parallel.mesh import DistLayout

WORST_METRICS = ("expert_load_imbalance", "rank_load_imbalance_before", "rank_load_imbalance_after")
TOTAL_METRICS = ("tokens_moved", "weight_bytes_moved", "llep_active")  # llep_active: layer passes that spilled


@dataclass(frozen=True)
class BalanceOptions:
    """How tokens are placed over the expert group (the `parallel.llep_*` settings)."""

    mode: str = "ep"
    gate: float = 1.3
    alpha: float = 1.0
    min_chunk: int = 1024
    chunks: int = 1  # > 1: the memory-efficient chunked variant (`llep_chunked`)

    def plan(self, loads: list[int], ranks: int) -> Plan:
        if self.mode == "llep":
            return plan_llep(loads, ranks, gate=self.gate, alpha=self.alpha, min_chunk=self.min_chunk)
        return plan_ep(loads, ranks)


@dataclass
class LayerRoute:
    """One layer pass's routing, built once in its forward and reused by a checkpointed block's
    recomputation. Its row permutations (`routing`'s, or the chunked `job`'s) stay on the device
    until the block's backward, offload or not: about 16 bytes per token-expert assignment per layer."""

    count_matrix: list[list[int]]
    loads: list[int]
    plan: Plan
    routing: Routing | None  # None when chunked: the `job` carries each chunk's
    exchange: Exchange
    job: ChunkJob | None


class _Dispatch(torch.autograd.Function):
    """Token all-to-all plus weight shipping in forward; their inverses together in backward.

    The owned weights are context, not inputs: the gradients helpers return for them are added to
    their `.grad` directly (`add_to_grad`); the native GEMMs' gradients reach them through autograd.
    """

    @staticmethod
    def forward(ctx, x_send, owned: tuple[torch.Tensor, ...], exchange: Exchange):
        ctx.exchange, ctx.owned = exchange, owned
        foreign, works = start_weight_shipping(owned, exchange)
        received = x_send.new_empty((sum(exchange.recv_splits), x_send.shape[1]))
        dist.all_to_all_single(received, x_send.contiguous(), exchange.recv_splits, exchange.send_splits,
                               group=exchange.group)
        wait_for(works)
        # a frozen expert tensor's shipped copy needs no gradient, and none goes back for it
        ctx.mark_non_differentiable(*(w for w, own in zip(foreign, owned) if not own.requires_grad))
        return received, *foreign

    @staticmethod
    def backward(ctx, grad_received, *grad_foreign):
        exchange, owned = ctx.exchange, ctx.owned
        foreign_grads = [g if g is not None else grad_received.new_zeros((len(exchange.receive), *w.shape[1:]))
                         for g, w in zip(grad_foreign, owned) if w.requires_grad]
        returned, works = start_gradient_return(foreign_grads, owned, exchange)
        grad_x = grad_received.new_empty((sum(exchange.send_splits), grad_received.shape[1]))
        dist.all_to_all_single(grad_x, grad_received.contiguous(), exchange.send_splits, exchange.recv_splits,
                               group=exchange.group)
        finish_gradient_return(owned, exchange, returned, works)
        return grad_x, None, None


class ExpertParallel(KeepsForwardOutputs, nn.Module):
    """Drop-in experts module for one rank of an expert group; see the module docstring."""

    def __init__(self, experts: nn.Module, layout: DistLayout, options: BalanceOptions):
        super().__init__()
        self.kind = experts.kind
        self.ranks = layout.layout.expert
        self.rank = layout.layout.expert_partition(layout.rank)
        self.num_experts = experts.num_experts
        self.per_rank = self.num_experts // self.ranks
        owned = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        for name, full in zip(self.kind.names, self.kind.stacked(experts)):
            part = full.detach()[owned].clone()
            self.register_parameter(name, nn.Parameter(part, requires_grad=full.requires_grad))
        self.group, self.p2p_group = layout.expert_group, layout.expert_p2p_group
        self.options = options
        self.records: list[dict] = []

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids.shape[-1]
        order, counts = expert_order(expert_ids, self.num_experts)
        # In a checkpointed block's recomputation the route (count matrix, plan, row permutations,
        # transfers) is the forward's: no count exchange, no host work, no second record; the chunked
        # path computes nothing there (`ChunkedExperts`: its backward recomputes what it needs).
        route = self.kept_output()
        replaying = route is not None
        if not replaying:
            # The layer pass's one device-to-host synchronisation: the [Ep, E] count matrix.
            route = self._route(all_gather_rows(counts.unsqueeze(0), self.group).tolist(), order, top_k, x.device)
            self._record(route.plan, route.loads, x)
        else:
            # The recomputed routing must be the forward's (checked on the device, no host sync).
            forward_counts = device_ints(route.count_matrix[self.rank], counts.device, counts.dtype)
            torch._assert_async((counts == forward_counts).all(),
                                "the recomputed routing differs from the forward's")
        owned = self.kind.stacked(self)
        self.keep_output(route)
        if route.job is not None:
            return ChunkedExperts.apply(x, weights.reshape(-1), owned, self.kind.compute, route.job, replaying)
        routing, exchange = route.routing, route.exchange
        assignment = order[routing.send_rows]
        received, *foreign = _Dispatch.apply(x[assignment // top_k], owned, exchange)
        y = expert_outputs(received, routing, self.kind.compute, owned, tuple(foreign))
        back = all_to_all(y, exchange.send_splits, exchange.recv_splits, self.group)
        y = back * weights.reshape(-1)[assignment].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(x).index_add_(0, assignment // top_k, y.to(x.dtype))

    def _route(self, count_matrix: list[list[int]], order: torch.Tensor, top_k: int, device) -> LayerRoute:
        loads = [sum(column) for column in zip(*count_matrix)]
        plan = self.options.plan(loads, self.ranks)
        if self.options.chunks > 1:  # each chunk's routing carries its own rows and token splits
            exchange = self._exchange(plan, [], [])
            job = chunk_job(plan, self.options.chunks, count_matrix, self.rank, order, exchange, top_k)
            return LayerRoute(count_matrix, loads, plan, None, exchange, job)
        routing = build_routing(plan, count_matrix, self.rank, device=device)
        exchange = self._exchange(plan, routing.send_splits, routing.recv_splits)
        return LayerRoute(count_matrix, loads, plan, routing, exchange, None)

    def _exchange(self, plan: Plan, send_splits: list[int], recv_splits: list[int]) -> Exchange:
        transfers = plan.transfers()
        ship = [(expert - self.rank * self.per_rank, helper) for expert, owner, helper in transfers if owner == self.rank]
        receive = [(expert, owner) for expert, owner, helper in transfers if helper == self.rank]
        return Exchange(send_splits, recv_splits, self.group, self.p2p_group, ship, receive)

    def drain_metrics(self) -> dict[str, tuple[str, float]]:
        """The routing summary of the forwards since the last call (`mop.metrics`): the worst
        imbalances, and the totals moved, reported by the group's first rank only (every rank of
        an expert group plans alike)."""
        records, self.records = self.records, []
        reports = self.rank == 0
        return {**{key: ("max", max((r[key] for r in records), default=0.0)) for key in WORST_METRICS},
                **{key: ("sum", sum(r[key] for r in records) if reports else 0.0) for key in TOTAL_METRICS}}

    def _record(self, plan: Plan, loads: list[int], x: torch.Tensor) -> None:
        native = plan_ep(loads, self.ranks).rank_loads()
        after = plan.rank_loads()
        weight_bytes = sum(t[0].nbytes for t in self.kind.stacked(self))
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


def check_settings(config: Config, world: int) -> None:
    """Expert parallelism's own settings: whole experts per partition, positive LLEP thresholds."""
    p = config.parallel
    for key in ("llep_gate", "llep_alpha"):
        if getattr(p, key) <= 0:
            raise ConfigError(f"parallel.{key}", f"must be > 0, got {getattr(p, key)}")
    if config.model.experts % p.expert:
        raise ConfigError("parallel.expert", f"{p.expert} does not divide model.experts={config.model.experts}")
