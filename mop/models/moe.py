"""Mixture-of-Experts feed-forward: softmax top-k router, stacked SwiGLU experts, shared expert.

Routing: `probs = softmax(x W_r^T)` in fp32, the top-k experts per token, their probabilities
optionally renormalised to sum to one. Expert e computes `down_e(silu(gate_e x) * up_e x)`; a
token's output is the routing-weighted sum over its k experts (plus the shared expert, if any).

Experts are stored stacked along the expert dimension, `w_gate_up [E, 2I, H]` (gate rows first,
then up rows) and `w_down [E, H, I]`, the layout of Hugging Face transformers v5, so that an
expert partition is a slice along E and one GEMM per expert reads contiguous memory.

`Experts.forward` is the seam expert parallelism replaces: it receives the tokens of this rank
with their routing decisions and returns their combined expert outputs. What expert parallelism
needs of an experts module is its `ExpertKind` (`kind`): the names of its stacked parameters
(dim 0 the expert) and the function computing the experts on rows sorted by expert; a family with
other experts (gpt_oss's biased ones) gives its own kind, and model code holds no collectives.

The layer also returns `RouterStats`, the per-sequence sums the load-balancing loss is built
from (see `load_balancing_loss`); keeping sums rather than means is what lets a parallel layout
reduce them over exactly the tokens of a sequence and reproduce the single-device loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.layers import SwiGLU
from mop.models.projections import GROUPED_DTYPES, Dense, Groups, Projection
from mop.models.shape import ModelShape


@dataclass
class RouterStats:
    """Per-sequence router sums, accumulated over the MoE layers of a forward pass.

    `assignments[b, e]`: token-expert assignments of row b to expert e (top-k picks, no grad).
    `prob_sum[b, e]`: sum over row b's tokens of the router probability of expert e (has grad).
    `rows[b]`: token-layer pairs that contributed (tokens of row b x MoE layers).
    `replay`: one layer's routing replay (`replay_counts`; None: nothing replayed), `selected`: the
    experts it ran for each token `[T, k]`, and `entropy`: the sum over its real tokens of the
    entropy of each token's router probabilities (normalised to sum 1: a sigmoid router's scores
    too; no grad), per layer only: a sum over layers keeps none of them
    (`MoETransformer.hidden_states` collects them layer by layer).
    """

    assignments: torch.Tensor
    prob_sum: torch.Tensor
    rows: torch.Tensor
    replay: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(self.assignments + other.assignments, self.prob_sum + other.prob_sum, self.rows + other.rows)


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """Switch-style loss `E * sum_e f_e P_e` per sequence, summed over the sequences of `stats`.

    f_e = assignments / rows and P_e = prob_sum / rows, pooled over all MoE layers of a sequence:
    for one sequence this is exactly Hugging Face's `load_balancing_loss_func`. The caller divides
    the sum by the global number of sequences, so the loss is a per-sequence mean whatever the
    micro-batching or layout. A sequence of padding only (the RL loop pads its batches with them) adds 0.
    """
    experts = stats.assignments.shape[-1]
    rows = stats.rows.clamp(min=1).unsqueeze(-1)  # no real row: its sums are 0, and 0 / 0 would be NaN
    per_sequence = experts * ((stats.assignments / rows) * (stats.prob_sum / rows)).sum(-1)
    return per_sequence.sum()


def replayed_selection(own: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """The experts a layer runs `[T, k]`: the recorded ones (`forced`, routing replay) where a token has
    them (-1: none), else the router's own top-k `own`."""
    if forced is None:
        return own
    return torch.where(forced[:, :1] >= 0, forced.to(own.dtype), own)


def replay_counts(own: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """`[2]` float64: the replayed tokens whose own top-k (as a set) differs from the recorded one, and
    the replayed tokens (those with a recorded selection)."""
    replayed = forced[:, 0] >= 0
    differs = (own.sort(-1).values != forced.to(own.dtype).sort(-1).values).any(-1) & replayed
    return torch.stack([differs.sum(), replayed.sum()]).double()


class Router(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None):
        """`x [T, H]` -> (fp32 probabilities [T, E], weights [T, k], expert ids [T, k], own top-k ids
        [T, k]); the ids are `forced`'s where given (`replayed_selection`), weighed by their live
        probabilities, so the router's gradient flows as for its own choice."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, own = torch.topk(probs, self.top_k, dim=-1)
        expert_ids = replayed_selection(own, forced)
        if forced is not None:
            weights = probs.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, expert_ids, own


@dataclass(frozen=True)
class GroupRoutingOptions:
    """The options of `GroupLimitedSigmoidRouter`, shared by the families that route with it (their
    `Options` derive from this class)."""

    groups: int = 1
    """`n_group`: the experts split into this many equal groups for group-limited routing."""
    groups_per_token: int = 1
    """`topk_group`: a token's experts come from its best this many groups."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: after each optimizer step every MoE layer's score-correction
    bias moves by this rate x sign(mean load - load), from the step's global expert counts
    (DeepSeek-V3 pre-trains with 0.001); 0 keeps it frozen, the fine-tuning default."""

    def routing_problems(self, model: ModelShape) -> list[tuple[str, str]]:
        problems = []
        if self.groups < 1 or model.experts % self.groups:
            problems.append(("groups", f"must be >= 1 and divide model.experts={model.experts}, got {self.groups}"))
        elif not 1 <= self.groups_per_token <= self.groups:
            problems.append(("groups_per_token", f"must be in [1, model.options.groups={self.groups}]"))
        elif model.top_k > self.groups_per_token * (model.experts // self.groups):
            problems.append(("groups_per_token", f"{self.groups_per_token} groups of {model.experts // self.groups} "
                                                 f"experts hold fewer than model.top_k={model.top_k}"))
        if self.router_bias_update_rate < 0:
            problems.append(("router_bias_update_rate", f"must be >= 0 (0 freezes the bias), got "
                                                        f"{self.router_bias_update_rate}"))
        return problems

    def router(self, model: ModelShape) -> "GroupLimitedSigmoidRouter":
        return GroupLimitedSigmoidRouter(model, self.groups, self.groups_per_token, self.routed_scaling_factor,
                                         self.router_bias_update_rate)


class GroupLimitedSigmoidRouter(nn.Module):
    """DeepSeek-V3 / GLM-4.5 routing, in fp32: `scores = sigmoid(x W_r^T)`; for selection only, the
    score-correction bias (a buffer: auxiliary-loss-free balancing moves it, the gradient never does)
    is added; the experts are split into `groups` equal groups, a group scores the sum of its two best
    corrected scores, and the top-k experts are chosen among the `groups_per_token` best groups. The
    weights are the chosen experts' uncorrected scores, optionally renormalised (+1e-20, as the
    reference), times `scaling` (`routed_scaling_factor`, applied in both cases).

    The first output, what the load-balancing statistics sum, is the scores normalised over the
    experts (DeepSeek-V3's sequence-wise balance loss uses these)."""

    def __init__(self, cfg: ModelShape, groups: int, groups_per_token: int, scaling: float,
                 bias_update_rate: float = 0.0):
        super().__init__()
        self.bias_update_rate = bias_update_rate  # read by MoETransformer.update_router_biases
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.register_buffer("score_correction_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.groups, self.groups_per_token, self.scaling = groups, groups_per_token, scaling

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.score_correction_bias.zero_()

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None):
        """`x [T, H]` -> (normalised fp32 scores [T, E], weights [T, k], expert ids [T, k], own top-k
        ids [T, k]); `forced` (routing replay, `replayed_selection`) replaces the selection only: the
        weights are the live scores of the experts run."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.score_correction_bias
        per_group = choice.shape[-1] // self.groups
        group_scores = choice.unflatten(-1, (self.groups, per_group)).topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(self.groups_per_token, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=-1), float("-inf"))
        own = choice.topk(self.top_k, dim=-1).indices
        expert_ids = replayed_selection(own, forced)
        weights = scores.gather(-1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores / scores.sum(dim=-1, keepdim=True), weights * self.scaling, expert_ids, own


def expert_order(expert_ids: torch.Tensor, experts: int):
    """Sort token-expert assignments by expert: (order into the flat [T*k] list, counts per expert)."""
    flat = expert_ids.reshape(-1)
    # Counted by index_add_, not bincount: bincount reads its input's maximum back to the host (a
    # device synchronisation on CUDA in every layer).
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def grouped_gemm_applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes fp32/bf16/fp16 with 16-byte-aligned rows (H and I multiples of 16 bytes)."""
    return x.dtype in GROUPED_DTYPES and all(Dense(w).grouped_applies(x.dtype) for w in (w_gate_up, w_down))


def swiglu_experts(x_sorted: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   grouped: bool | None = None, align: int | None = None, probe: torch.Tensor | None = None):
    """Apply expert e to its contiguous run of `counts[e]` rows of `x_sorted`: `swiglu_projected` of
    the plain stacked tensors."""
    return swiglu_projected(x_sorted, counts, Dense(w_gate_up), Dense(w_down), grouped, align, probe)


def swiglu_projected(x_sorted: torch.Tensor, counts: list[int], gate_up: Projection, down: Projection,
                     grouped: bool | None = None, align: int | None = None, probe: torch.Tensor | None = None):
    """Expert e's `down(silu(gate) * up)`, `[gate | up] = gate_up(x)`, on its contiguous run of
    `counts[e]` rows of `x_sorted`, each projection applied as `mop.models.projections` does: one
    grouped GEMM where `torch._grouped_mm` applies (`grouped=None` decides), otherwise one GEMM per
    expert; the two give identical results (tested bit for bit). `align` pads the groups
    (`Groups.of`) with zero rows, so the real rows' outputs and the gradients are unchanged up to
    the kernel's summation order.

    With `probe` (rows like `x_sorted`, `[rows, H]`), the per-row fp32 product `<probe, expert(x)>`
    instead of the outputs, computed as `<probe W_down, hidden>` without the down projection's
    forward. Its backward, given each row's output weight w, is the experts' backward for the output
    gradient `w * probe`: `w * probe W_down` into the hidden activations, `sum w * probe^T hidden`
    into W_down. So a backward that has the rows and their output gradients (unweighted, `probe`)
    gets both the experts' gradients and the routing weights' gradient (the products) after
    re-running the gate and up projections alone, not the down projection.
    """
    groups = Groups.of(x_sorted, counts, (gate_up, down), grouped, align)
    gate, up = gate_up(groups.pad(x_sorted), groups).chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    if probe is None:
        return groups.unpad(down(hidden, groups))
    return groups.unpad(row_product(down.back(groups.pad(probe), groups), hidden))


def row_product(probe_down: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Per row `<probe W_down, hidden>` (= `<probe, hidden W_down^T>`), summed in fp32."""
    return (probe_down * hidden).sum(-1, dtype=torch.float32)


@dataclass(frozen=True)
class StackedProjection:
    """One of an experts module's stacked tensors that is a projection (`mop.models.projections`)."""

    name: str
    transposed: bool = False
    """Stored `[E, in, out]` and applied as `x W_e` (gpt-oss), rather than `[E, out, in]` and `x W_e^T`."""
    parts: tuple[int, ...] = ()
    """The parts its rows (dim 1) are made of, each a published tensor of its own (`w_gate_up`: the
    gate's rows, then the up's); what a block-scaled format blocks separately (`mop.models.formats`)."""


@dataclass(frozen=True)
class ExpertKind:
    """An experts module as expert parallelism (`mop.parallel.llep`) and adapters (`mop.models.lora`)
    see it, with no collectives.

    `names`: its stacked parameters, in order, each with the expert on dim 0: a partition is a
    slice of each along dim 0, and shipping expert e ships index e of each.
    `run(x_sorted, counts, tensors, **options, probe=None)`: the experts on rows sorted by expert,
    `counts[e]` rows for expert e (a host list), from `tensors` by name: its `projections` as
    `Projection`s, the other stacked tensors (biases) as they are; with `probe` (`[rows, H]`), each
    row's fp32 `<probe, expert(x)>` instead, whose backward for per-row weights w is the experts'
    backward for the output gradient `w * probe` (see `swiglu_projected`; the chunked path's
    backward relies on it). `options`: the run's own keyword arguments (`with_options`).
    """

    names: tuple[str, ...]
    run: Callable[..., torch.Tensor]
    projections: tuple[StackedProjection, ...]
    options: tuple[tuple[str, object], ...] = ()

    def with_options(self, **options) -> "ExpertKind":
        return replace(self, options=tuple(options.items()))

    def tensors(self, stacked: tuple[torch.Tensor, ...]) -> dict:
        """The stacked tensors by name, the projections as plain `Dense` ones."""
        tensors = dict(zip(self.names, stacked))
        for projection in self.projections:
            tensors[projection.name] = Dense(tensors[projection.name], projection.transposed)
        return tensors

    def compute(self, x_sorted: torch.Tensor, counts: list[int], stacked: tuple[torch.Tensor, ...],
                probe: torch.Tensor | None = None, **run_options) -> torch.Tensor:
        """The experts whose stacked tensors are `stacked` (one per name, E' experts each) on rows
        sorted by expert (see the class docstring); `run_options`: `grouped`, `align` of the run."""
        return self.run(x_sorted, counts, self.tensors(stacked), **dict(self.options), probe=probe, **run_options)

    def forward(self, module: nn.Module, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                **run_options) -> torch.Tensor:
        """A single-device experts module's forward: `x [T, H]`, `expert_ids, weights [T, k]` ->
        `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` (`module.num_experts` experts)."""
        top_k = expert_ids.shape[-1]
        order, counts = expert_order(expert_ids, module.num_experts)
        token_of = order // top_k
        y = self.compute(x[token_of], counts.tolist(), self.stacked(module), **run_options)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))

    def stacked(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        """`module`'s stacked parameters in `names`' order."""
        return tuple(getattr(module, name) for name in self.names)


def swiglu_run(x_sorted: torch.Tensor, counts: list[int], tensors: dict, grouped: bool | None = None,
               align: int | None = None, probe: torch.Tensor | None = None) -> torch.Tensor:
    """The shared SwiGLU experts' `ExpertKind.run`: `swiglu_projected` of `w_gate_up`, `w_down`."""
    return swiglu_projected(x_sorted, counts, tensors["w_gate_up"], tensors["w_down"], grouped, align, probe)


def swiglu_kind(cfg: ModelShape) -> ExpertKind:
    """The shared SwiGLU experts' kind: `w_gate_up` holds each expert's gate rows, then its up rows."""
    inter = cfg.expert_intermediate
    return ExpertKind(("w_gate_up", "w_down"), swiglu_run,
                      (StackedProjection("w_gate_up", parts=(inter, inter)), StackedProjection("w_down")))


class Experts(nn.Module):
    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.kind = swiglu_kind(cfg)
        self.num_experts = cfg.experts
        self.w_gate_up = nn.Parameter(torch.empty(cfg.experts, 2 * cfg.expert_intermediate, cfg.hidden))
        self.w_down = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.expert_intermediate))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`x [T, H]`, `expert_ids, weights [T, k]` -> `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`."""
        return self.kind.forward(self, x, expert_ids, weights)


class MoE(nn.Module):
    """An MoE layer: the family's router and routed experts (handed over by its block: `Router` and
    `Experts` by default) and an optional shared expert."""

    def __init__(self, cfg: ModelShape, router=Router, experts=Experts):
        super().__init__()
        self.router = router(cfg)
        self.experts = experts(cfg)
        self.shared = SwiGLU(cfg.hidden, cfg.shared_expert_intermediate) if cfg.shared_expert_intermediate else None

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None, routes: torch.Tensor | None = None):
        """`x [B, S, H]` -> (output [B, S, H], RouterStats for the B rows over the tokens not flagged
        in `padding [B, S]`). `routes [B, S, k]` (None: none) replays recorded selections (-1: a token
        without one routes itself): the experts run are those, the stats count them, and
        `RouterStats.replay` says how many differ from the router's own choice."""
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        forced = None if routes is None else routes.reshape(batch * seq, -1)
        probs, weights, expert_ids, own = self.router(flat, forced)
        out = self.experts(flat, expert_ids, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        stats = self._stats(probs, expert_ids, batch, padding)
        stats.selected = expert_ids
        if forced is not None:
            stats.replay = replay_counts(own, forced)
        return out.view(batch, seq, hidden), stats

    @staticmethod
    def _stats(probs: torch.Tensor, expert_ids: torch.Tensor, batch: int, padding: torch.Tensor | None) -> RouterStats:
        experts = probs.shape[-1]
        ids = expert_ids.view(batch, -1)
        probs = probs.view(batch, -1, experts)
        # [B, S]: each token's k picks and its probabilities count when it is real (not padding)
        real = probs.new_ones(probs.shape[:2]) if padding is None else (~padding).to(probs.dtype)
        per_pick = real.repeat_interleave(ids.shape[1] // real.shape[1], dim=1)
        picks = probs.new_zeros(batch, experts).scatter_add_(1, ids, per_pick)
        with torch.no_grad():
            shares = probs.detach().float()
            shares = shares / shares.sum(-1, keepdim=True).clamp(min=1e-30)
            entropy = -(shares * shares.clamp(min=1e-30).log()).sum(-1)  # [B, S]
        return RouterStats(picks, (probs * real.unsqueeze(-1)).sum(1), real.sum(1).float(),
                           entropy=(entropy * real).sum())
