"""The decoder-only MoE transformer: embedding, blocks of (attention, MoE or dense MLP), head.

Pre-norm residual blocks, as in Qwen3-MoE and Mixtral:
    h = h + attention(attn_norm(h));  h = h + mlp(mlp_norm(h))
The first `dense_layers` blocks use a dense SwiGLU MLP, the rest an MoE layer; the attention is
the family's (`mop.models.families`).

No collectives live here. A parallel layout changes what each module computes on by swapping
five seams: `MoETransformer.documents` (the micro-batch's document spans, once per forward),
`Attention.core` (sequence mixing), `Experts` (the routed FFN), `MoETransformer.router_sums`
(the per-sequence router sums the load-balancing loss reads) and `LMHead` (the vocabulary
projection and loss); everything else runs on the rank's own tokens unchanged. Multi-token
prediction's depths (`mop.models.mtp`; their blocks follow the model's in `layers`) add a seam,
`MoETransformer.lookahead` (the tokens after a rank's own).

Losses are returned as sums with their counts (`LossTerms`), never as per-rank means: a step's
objective is `ce_sum / global_targets + aux_coef * aux_sum / global_sequences` (+ the MTP depths'
`mtp_loss_coef / D x sum_k ce_k / targets_k`), which any layout and any micro-batching reproduces
exactly.

Preference pairs (DPO, `mop.objectives.preference`): `preference_terms` sums each response's target
log-probabilities over its tokens (`PreferenceTerms`), whichever rank holds them: a sixth seam,
`MoETransformer.response_sums`, is the identity here and sums a sequence group's slices under
sequence parallelism (its D ranks then each hold every response's sums, `copies` = D).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.config import ModelConfig
from mop.models.documents import DocumentBoundaries, Documents
from mop.models.families import family_of
from mop.models.layers import RMSNorm, SwiGLU
from mop.models.lora import (
    LoraConfig,
    adapter_init_bound,
    add_adapters,
    stored_rows,
    stored_tensors,
)
from mop.models.moe import MoE, RouterStats, load_balancing_loss
from mop.models.mtp import MtpModule, TokenLookahead
from mop.profiling import vocabulary_scope

IGNORE_INDEX = -100
ENTROPY_BLOCK_BYTES = 64 * 2**20  # one fp32 temporary of a block of rows' entropy (LMHead)


@dataclass
class LossTerms:
    """Summed loss terms of a forward pass and the counts they are to be divided by."""

    ce_sum: torch.Tensor
    """Sum of token cross-entropies over the targets that are not IGNORE_INDEX."""
    targets: int
    """Number of such targets."""
    router: RouterStats | None
    """Per-sequence router sums (None for a model without MoE layers)."""
    sequences: int
    """Number of sequences (rows) in the forward pass."""
    expert_stats: torch.Tensor | None = None
    """`[moe_layers, E + 1]` (no grad), per MoE layer (the MTP depths' blocks after the others): the
    token-expert assignments of this forward's own tokens per expert, what auxiliary-loss-free
    balancing (`update_router_biases`) reads, then the sum of their router entropies
    (`RouterStats.entropy`); summed over a step's micro-batches and ranks. Taken from the forward's
    outputs, never from a checkpointed block's recomputation, so each token counts once."""
    mtp_ce: torch.Tensor | None = None
    """`[D]`: each multi-token-prediction depth's cross-entropy summed over its targets
    (`mop.models.mtp`; None without MTP modules)."""


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        family = family_of(cfg)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = family.attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.is_moe = layer >= cfg.dense_layers
        self.mlp = (MoE(cfg, family.router, family.experts) if self.is_moe
                    else SwiGLU(cfg.hidden, cfg.dense_intermediate))

    def forward(self, h, position_ids, documents: Documents | None, padding: torch.Tensor | None = None,
                routes: torch.Tensor | None = None):
        """`routes [B, S, k]` (an MoE block's, None: none): the selections it replays (`MoE.forward`);
        an argument of the block, so a checkpointed block's recomputation replays the same ones."""
        h = h + self.attention(self.attn_norm(h), position_ids, documents)
        if not self.is_moe:
            return h + self.mlp(self.mlp_norm(h)), None
        out, stats = self.mlp(self.mlp_norm(h), padding, routes)
        return h + out, stats


@dataclass
class Trunk:
    """What the blocks of a forward give the head (`MoETransformer.hidden_states`)."""

    hidden: torch.Tensor
    """Final-norm hidden states `[B, S, H]`."""
    router: RouterStats | None
    """The router sums of every MoE layer (None without MoE layers)."""
    expert_stats: torch.Tensor | None
    """Each MoE layer's expert counts and summed router entropy `[moe_layers, E + 1]`
    (`LossTerms.expert_stats`; None without MoE layers)."""
    replay: torch.Tensor | None = None
    """Each MoE layer's routing replay `[moe_layers, 2]` (`mop.models.moe.replay_counts`: tokens whose own
    top-k differs from the replayed one, tokens replayed), None without routes."""
    routes: torch.Tensor | None = None
    """The experts every MoE layer ran for each token `[B, S, moe_layers, k]` (int16, -1 on padding:
    what a later forward replays, `hidden_states`' `routes`), when asked for (`record_routes`)."""
    position_ids: torch.Tensor | None = None
    """The positions the blocks rotated by `[B, S]` (what the MTP depths' blocks use too)."""
    documents: Documents | None = None
    """The forward's document spans (`MoETransformer.documents`; the MTP depths' blocks reuse them)."""


@dataclass
class PreferenceTerms:
    """Per-response sums of a forward pass over packed preference pairs: slot `2 * (row * pairs_max +
    j) + side` holds pair j of that row's chosen (side 0) or rejected (side 1) response."""

    logps: torch.Tensor
    """`[B * pairs_max, 2]` float64 sums of the responses' fp32 target log-probabilities (with gradient)."""
    targets: torch.Tensor
    """`[B * pairs_max, 2]` their target counts (float64, no gradient); a slot no pair fills counts 0."""
    reference: torch.Tensor | None
    """`[B * pairs_max, 2]` the batch's stored reference sums (`reference_logps`), None without them."""
    router: RouterStats | None
    sequences: int
    expert_stats: torch.Tensor | None = None


@dataclass
class PolicyTerms:
    """Per-token terms of a forward pass over packed rollouts (`mop.objectives.policy_gradient`)."""

    logps: torch.Tensor
    """`[B, S]` each token's fp32 log-probability of its label (with gradient; 0 where ignored)."""
    entropy: torch.Tensor
    """`[B, S]` the entropy of each token's next-token distribution (fp32, no gradient)."""
    router: RouterStats | None
    sequences: int
    expert_stats: torch.Tensor | None = None
    replay: torch.Tensor | None = None
    """`[moe_layers, 2]` the routing replay's counts (`Trunk.replay`), None without routes."""
    routes: torch.Tensor | None = None
    """`[B, S, moe_layers, k]` the experts run (`Trunk.routes`), when recorded."""


class RouterSums(nn.Module):
    """The model's seam for a forward's router sums: here those of the rank's own tokens, each
    sequence held once (`copies`). Sequence parallelism swaps it for one that sums each sequence's
    slices over its group, whose D ranks then each hold the sequence's sums (`copies` = D)."""

    copies = 1

    def forward(self, stats: RouterStats) -> RouterStats:
        return stats


class ResponseSums(nn.Module):
    """The model's seam for per-response sums `[3, slots]` (log-probs, counts, reference): here the
    rank's own tokens hold whole responses. Sequence parallelism swaps it for one that sums a
    sequence group's slices (`mop.parallel.ulysses.SequenceResponseSums`, `copies` = D)."""

    copies = 1

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return sums


class LMHead(nn.Module):
    """Output projection `[V, H]` and the summed cross-entropy over a rank's own tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden))
        self.z_loss_coef = cfg.z_loss_coef

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)

    def token_logprobs(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each token's fp32 log-probability of its target `[B, S]` (0 where the target is ignored)."""
        logits = self(h).float()
        picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(labels != IGNORE_INDEX, picked, torch.zeros_like(picked))

    def token_logprobs_and_entropy(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_logprobs` and each token's entropy of its next-token distribution `[B, S]` (fp32,
        no gradient: a record)."""
        logits = self(h).float()
        logps = logits.log_softmax(-1)
        picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():  # in blocks of rows: each block's temporaries about ENTROPY_BLOCK_BYTES, not [N, V]
            rows = logps.detach().view(-1, logps.shape[-1])
            block = max(1, ENTROPY_BLOCK_BYTES // (4 * rows.shape[-1]))
            entropy = torch.cat([-(part.exp() * part).sum(-1) for part in rows.split(block)]).view(labels.shape)
        return torch.where(labels != IGNORE_INDEX, picked, torch.zeros_like(picked)), entropy

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum over non-ignored targets of cross-entropy + z_loss_coef * logsumexp(logits)^2."""
        logits = self(h).float().view(-1, self.weight.shape[0])
        labels = labels.reshape(-1)
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        if self.z_loss_coef:
            lse = torch.logsumexp(logits[labels != IGNORE_INDEX], dim=-1)
            loss = loss + self.z_loss_coef * lse.square().sum()
        return loss


def layer_expert_stats(stats: RouterStats) -> torch.Tensor:
    """One MoE layer's row of `LossTerms.expert_stats`: its expert counts, then its summed router entropy."""
    return torch.cat([stats.assignments.sum(0), stats.entropy.view(1).to(stats.assignments.dtype)])


def mtp_targets(labels: torch.Tensor, position_ids: torch.Tensor, depth: int) -> list[int]:
    """The targets of each MTP depth k = 1..`depth` among these tokens (`mop.models.mtp`): the labels
    not ignored at positions at least k into their document (a target of depth k sits k tokens
    after the position that predicts it)."""
    kept = labels != IGNORE_INDEX
    return [int((kept & (position_ids >= k)).sum()) for k in range(1, depth + 1)]


def document_positions(document_ids: torch.Tensor, prefix_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that restart at 0 wherever `document_ids [B, S]` changes along the sequence, or
    at the prefix's length in a branch (`prefix_lengths`: its positions continue its prefix's)."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - start_index + (prefix_lengths if prefix_lengths is not None else 0)


class MoETransformer(nn.Module):
    FORWARD_METHODS = ("loss_terms", "preference_terms", "policy_terms")
    """The entry points an objective calls instead of `forward` (FSDP2 gathers the root's weights for each)."""

    def __init__(self, cfg: ModelConfig, lora: LoraConfig | None = None):
        """`lora`: LoRA fine-tuning's adapters over a frozen base (`mop.models.lora.add_adapters`); the
        settings are kept as `self.lora` (None: every parameter trains)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.documents = DocumentBoundaries()
        self.router_sums = RouterSums()
        self.response_sums = ResponseSums()
        # the MTP depths' blocks follow the model's (`mop.models.mtp`), so every technique wraps them alike
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers + cfg.trained_mtp_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = LMHead(cfg)
        self.mtp = nn.ModuleList(MtpModule(cfg) for _ in range(cfg.trained_mtp_layers))
        self.lookahead = TokenLookahead()
        self.tie_weights()
        self.lora = None
        if lora is not None:
            add_adapters(self, lora)

    def tie_weights(self) -> None:
        """With `tie_embeddings`, the output projection is the embedding's weight (one parameter)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def cast_parameters(self, dtype: torch.dtype, frozen_dtype: torch.dtype | None = None) -> "MoETransformer":
        """The trained parameters in `dtype`, the frozen ones in `frozen_dtype` (None: `dtype`); a
        weight stored in a published format keeps its format's dtypes (a module's
        `stored_parameters`), the buffers theirs (a router's fp32 score-correction bias, which
        selection compares at fp32 resolution)."""
        for module in self.modules():
            stored = getattr(module, "stored_parameters", ())
            for name, param in module.named_parameters(recurse=False):
                if name in stored:
                    continue
                target = dtype if param.requires_grad or frozen_dtype is None else frozen_dtype
                setattr(module, name, nn.Parameter(param.to(target), requires_grad=param.requires_grad))
        self.tie_weights()
        return self

    def reset_buffers(self) -> None:
        """Give the buffers their initial values after `to_empty` left them uninitialised (a router's
        score-correction bias starts at zero)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()

    def hidden_states(self, input_ids, position_ids=None, document_ids=None, padding=None, prefix_lengths=None,
                      routes=None, record_routes: bool = False) -> Trunk:
        """The blocks' outputs (`Trunk`); tokens flagged in `padding [B, S]` (bool, None: none) are
        computed but left out of the router sums and counts. `prefix_lengths [B, S]` (None: none)
        makes branches (`mop.models.documents`): a document that also attends to the first tokens of
        the one before it, its positions continuing theirs. `routes [B, S, moe_layers, k]` (None:
        none) are the experts each MoE layer replays for each token (routing replay; -1: none);
        `record_routes` returns those every MoE layer ran (`Trunk.routes`)."""
        if position_ids is None:
            position_ids = document_positions(document_ids, prefix_lengths) if document_ids is not None else (
                torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids))
        documents = self.documents(document_ids, prefix_lengths)  # once per forward, shared by every layer
        h = self.embed(input_ids)
        router, expert_stats, replay, selected = None, [], [], []
        for layer, block in enumerate(self.layers[:self.cfg.layers]):
            moe = layer - self.cfg.dense_layers  # the MoE layers' index (Block.is_moe)
            layer_routes = None if routes is None or moe < 0 else routes[:, :, moe]
            h, stats = block(h, position_ids, documents, padding, layer_routes)
            if stats is not None:
                router = stats if router is None else router + stats
                expert_stats.append(layer_expert_stats(stats))
                replay.append(stats.replay)
                if record_routes:
                    selected.append(stats.selected.view(*input_ids.shape, -1).to(torch.int16))
        recorded = torch.stack(selected, 2) if selected else None
        if recorded is not None and padding is not None:  # padding replays nothing (-1), as the rollouts' routes
            recorded = recorded.masked_fill(padding[:, :, None, None], -1)
        return Trunk(self.norm(h), router, torch.stack(expert_stats) if expert_stats else None,
                     torch.stack(replay) if routes is not None and expert_stats else None, recorded, position_ids,
                     documents)

    def loss_terms(self, input_ids, labels, position_ids=None, document_ids=None, padding=None,
                   prefix_lengths=None, mtp: bool = True) -> LossTerms:
        """Summed losses; `labels [B, S]` are the already-shifted next-token targets (IGNORE_INDEX skips);
        `padding [B, S]` flags tokens that are no data, `prefix_lengths` branches (`hidden_states`);
        `mtp`: the MTP depths' too, if the model has them (an evaluation reads the main loss only)."""
        if len(self.mtp) and prefix_lengths is not None:
            raise ValueError("multi-token prediction reads documents by their positions, which branches continue; "
                             "it trains on next-token data without prefix sharing")
        trunk = self.hidden_states(input_ids, position_ids, document_ids, padding, prefix_lengths)
        with vocabulary_scope():  # a profiled step's phase (`mop.profiling`)
            ce_sum = self.lm_head.loss_sum(trunk.hidden, labels)
        targets = int((labels != IGNORE_INDEX).sum())
        mtp_ce = self._multi_token_prediction(trunk, input_ids, labels, padding) if mtp and len(self.mtp) else None
        return LossTerms(ce_sum, targets, self._router_sums(trunk), input_ids.shape[0], trunk.expert_stats, mtp_ce)

    def _multi_token_prediction(self, trunk: Trunk, input_ids, labels, padding) -> torch.Tensor:
        """Each MTP depth's summed cross-entropy `[D]` (`mop.models.mtp`). Its blocks' router sums and
        expert statistics are added to `trunk`'s (in place: the head's terms read them after): a
        position whose token k ahead is in another document, or past the row, is computed as padding."""
        depth, seq = len(self.mtp), input_ids.shape[-1]
        ahead = self.lookahead(torch.stack([input_ids, labels, trunk.position_ids.to(input_ids)]), depth)
        h, ce, stats = trunk.hidden, [], [] if trunk.expert_stats is None else [trunk.expert_stats]
        for k, module in enumerate(self.mtp, start=1):
            ids, targets, positions = ahead[..., k:k + seq].unbind(0)
            outside = positions < k  # no token of its document k ahead
            h = module(h, self.embed(ids.clamp(min=0)))
            h, layer = self.layers[self.cfg.layers + k - 1](h, trunk.position_ids, trunk.documents,
                                                            outside if padding is None else outside | padding)
            with vocabulary_scope():
                ce.append(self.lm_head.loss_sum(module.norm(h), torch.where(outside, IGNORE_INDEX, targets)))
            trunk.router = layer if trunk.router is None else trunk.router + layer
            stats.append(layer_expert_stats(layer)[None])
        trunk.expert_stats = torch.cat(stats)
        return torch.stack(ce)

    def preference_terms(self, input_ids, labels, response_ids, pairs_max: int, position_ids=None, document_ids=None,
                         padding=None, prefix_lengths=None, reference_logps=None) -> PreferenceTerms:
        """Each response's summed target log-probabilities (`PreferenceTerms`). `response_ids [B, S]`:
        `2 * j + side` on the tokens whose label lies in pair j's response `side` of their row (-1
        elsewhere); `pairs_max`: the slots per row; `reference_logps [B, S]` (None: none): each
        response's reference sum on one of its tokens, summed into the slots alongside."""
        trunk = self.hidden_states(input_ids, position_ids, document_ids, padding, prefix_lengths)
        with vocabulary_scope():
            logp = self.lm_head.token_logprobs(trunk.hidden, labels)
        rows, slots = input_ids.shape[0], 2 * pairs_max
        in_response = response_ids >= 0
        trained = in_response & (labels != IGNORE_INDEX)
        row_base = torch.arange(rows, device=input_ids.device).unsqueeze(1) * slots
        slot = torch.where(in_response, row_base + response_ids, 0).flatten()
        # float64 sums: DPO reads differences of sums of hundreds of log-probs, which fp32 would round
        # differently in each layout; the sums are small ([3, B x slots]).
        zero = torch.zeros(rows * slots, dtype=torch.float64, device=input_ids.device)
        parts = [zero.index_add(0, slot, torch.where(trained, logp, 0).flatten().double()),
                 zero.index_add(0, slot, trained.flatten().double())]
        if reference_logps is not None:
            parts.append(zero.index_add(0, slot, torch.where(in_response, reference_logps, 0).flatten().double()))
        # Copies, not views of one tensor: FSDP2 hooks a wrapped model's outputs and warns on views.
        sums = self.response_sums(torch.stack(parts)).view(len(parts), rows * pairs_max, 2).unbind(0)
        logps, targets, *reference = (part.clone() for part in sums)
        return PreferenceTerms(logps, targets.detach(), reference[0].detach() if reference else None,
                               self._router_sums(trunk), rows, trunk.expert_stats)

    def _router_sums(self, trunk: Trunk) -> RouterStats | None:
        """The forward's router sums over its sequences (the `router_sums` seam)."""
        return self.router_sums(trunk.router) if trunk.router is not None else None

    def policy_terms(self, input_ids, labels, position_ids=None, document_ids=None, padding=None,
                     routes=None, record_routes: bool = False) -> PolicyTerms:
        """Each token's target log-probability and entropy (`PolicyTerms`), the experts of `routes
        [B, S, moe_layers, k]` replayed (`hidden_states`; None: the router's own), those run recorded
        with `record_routes`."""
        trunk = self.hidden_states(input_ids, position_ids, document_ids, padding, routes=routes,
                                   record_routes=record_routes)
        with vocabulary_scope():
            logps, entropy = self.lm_head.token_logprobs_and_entropy(trunk.hidden, labels)
        # Copies, not views: FSDP2 hooks a wrapped model's outputs and warns on views.
        return PolicyTerms(logps.clone(), entropy.clone(), self._router_sums(trunk), input_ids.shape[0],
                           trunk.expert_stats, trunk.replay, trunk.routes)

    @torch.no_grad()
    def update_router_biases(self, expert_counts: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer's router that has a bias
        update rate moves its score-correction bias by `rate x sign(mean load - load)`, from the
        step's global counts `[moe_layers, E]` (the same on every rank, so every layout and the
        reference move it alike)."""
        for router, counts in zip(self._routers(), expert_counts):
            if getattr(router, "bias_update_rate", 0):
                router.score_correction_bias += router.bias_update_rate * torch.sign(counts.mean() - counts)

    @property
    def balances_router_biases(self) -> bool:
        return any(getattr(router, "bias_update_rate", 0) for router in self._routers())

    def _routers(self) -> list[nn.Module]:
        """The MoE layers' routers in layer order (found by module, so a parallelized model's wrapped
        blocks serve too)."""
        return [module.router for module in self.modules() if isinstance(module, MoE)]

    def objective(self, terms: LossTerms, global_targets: int, global_sequences: int,
                  mtp_targets: tuple[int, ...] = ()) -> torch.Tensor:
        """This forward pass's share of the step loss normalised by the step's global counts (a
        sequence whose router sums `copies` ranks hold contributes 1/copies on each); with MTP
        depths, `mtp_targets` are the step's counts of each depth's targets (`mtp_targets`)."""
        loss = terms.ce_sum / max(global_targets, 1) + self.aux_objective(terms.router, global_sequences)
        return loss + self.mtp_objective(terms.mtp_ce, mtp_targets) if terms.mtp_ce is not None else loss

    def mtp_objective(self, mtp_ce: torch.Tensor, mtp_targets: tuple[int, ...]) -> torch.Tensor:
        """The MTP depths' share of the step loss: `mtp_loss_coef / D x sum_k ce_k / targets_k` (`mop.models.mtp`)."""
        if len(mtp_targets) != len(mtp_ce):
            raise ValueError(f"{len(mtp_ce)} MTP depths need as many target counts (`mtp_targets`), "
                             f"got {len(mtp_targets)}")
        counts = mtp_ce.new_tensor([max(n, 1) for n in mtp_targets])
        return self.cfg.mtp_loss_coef / len(mtp_targets) * (mtp_ce / counts).sum()

    def aux_objective(self, router: RouterStats | None, global_sequences: int) -> torch.Tensor | float:
        """The load-balancing loss's share of the step loss: `aux_coef x` the forward's summed
        per-sequence losses over the step's sequences (each held by `router_sums.copies` ranks)."""
        if router is None or not self.cfg.aux_loss_coef:
            return 0.0
        sequences = global_sequences * self.router_sums.copies
        return self.cfg.aux_loss_coef * load_balancing_loss(router) / sequences

    def forward(self, input_ids, labels=None, position_ids=None, document_ids=None, prefix_lengths=None):
        """Logits `[B, S, V]` without labels; with labels, the mean loss over this batch's targets."""
        if labels is None:
            return self.lm_head(self.hidden_states(input_ids, position_ids, document_ids,
                                                   prefix_lengths=prefix_lengths).hidden)
        terms = self.loss_terms(input_ids, labels, position_ids, document_ids, prefix_lengths=prefix_lengths)
        if position_ids is None and len(self.mtp):
            position_ids = document_positions(document_ids) if document_ids is not None else (
                torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids))
        counts = tuple(mtp_targets(labels, position_ids, len(self.mtp))) if len(self.mtp) else ()
        return self.objective(terms, terms.targets, terms.sequences, counts)


INIT_BLOCK = 1 << 20  # elements drawn from one generator key


def parameter_seed(seed: int, name: str) -> int:
    """A per-parameter seed from the run seed and the parameter's name, independent of layout and order."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1


def initial_rows(name: str, shape: torch.Size, first: int, count: int, seed: int, std: float) -> torch.Tensor:
    """Rows `[first, first + count)` (dim 0) of parameter `name`'s initial value, fp32 on the CPU.

    Biases and attention sinks (names ending in `bias` or `sinks`) start at zero, as transformers
    initialises them, and so do LoRA's B adapters (PEFT's: step 0 is the base model); other 1-D
    parameters (norm weights) at one. A matrix is N(0, std), a LoRA A adapter uniform in
    +-1/sqrt(in) (PEFT's, `adapter_init_bound`), drawn in blocks of INIT_BLOCK consecutive elements
    of its flattened global tensor, block b from a generator keyed by (seed, name, b): any block of
    rows is computed without drawing the others, so every rank initialises its own shard alone and
    every layout (the single-process model included) starts from the same values, bit for bit, on
    any device.
    """
    if name.endswith(("bias", "sinks", "lora_B")):
        return torch.zeros(count, *shape[1:])
    if len(shape) == 1:
        return torch.ones(count)
    bound = adapter_init_bound(shape) if name.endswith("lora_A") else None
    row = math.prod(shape[1:])
    start, stop, total = first * row, (first + count) * row, math.prod(shape)
    out = torch.empty(stop - start)
    for block in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        begin = block * INIT_BLOCK
        generator = torch.Generator().manual_seed(parameter_seed(seed, f"{name}/{block}"))
        values = torch.empty(min(INIT_BLOCK, total - begin))
        values = values.normal_(0.0, std, generator=generator) if bound is None else (
            values.uniform_(-bound, bound, generator=generator))
        low, high = max(start, begin), min(stop, begin + INIT_BLOCK)
        out[low - start:high - start] = values[low - begin:high - begin]
    return out.view(count, *shape[1:])


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter of a full (unsharded) module from `seed` alone (`initial_rows`; a
    weight kept in a published format, quantized from those: `mop.models.lora.stored_rows`)."""
    rows = stored_rows(partial(initial_rows, seed=seed, std=std), stored_tensors(module))
    for name, param in module.named_parameters():
        param.copy_(rows(name, param.shape, 0, param.shape[0]))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu",
                lora: LoraConfig | None = None) -> MoETransformer:
    """The whole model on one device, initialised: for tests, conversion and single-process tools
    (a training run builds each rank's shards only: `mop.build`). With `lora`, adapters over the
    frozen base (a quantized `base_format` quantized from the initial values)."""
    with torch.device("meta"):
        model = MoETransformer(cfg, lora)
    model.to_empty(device=device)
    model.tie_weights()  # `to_empty` replaces the parameters one module at a time
    model.reset_buffers()
    init_weights(model, seed, cfg.init_std)
    return model
