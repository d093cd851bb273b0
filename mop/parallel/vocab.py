"""Vocabulary parallelism: a row-sharded output projection and a ring cross-entropy over own tokens.

Layout. The output projection `[V, H]` is padded to `P * ceil(V/P)` rows and split into P row
shards; rank r of a vocabulary group (P consecutive ranks) holds shard j = r mod P, and the W/P
ranks holding the same j (its vocabulary-replica group) hold identical copies. Every rank keeps
its own hidden states `[N, H]` and targets: no token moves.

Forward ring (P steps): rank r holds shard (r + s) mod P at step s. While it computes with that
shard, the shard is sent on to rank r-1 and the next arrives from rank r+1 (`batch_isend_irecv`).
For each block of `token_block` tokens it forms the `[block, V/P]` logits against the shard
(padding columns masked out), folds them into a running max and log-sum-exp per token, and picks
up the target logit if the target lives in the shard. Only one logit tile is live at a time; the
full `[N, V]` logits never exist.

Elementwise passes. A tile's passes (max, shift, exponential, sum; in the recomputing backward
shift, exponential, scale) are each one kernel over the whole tile on a GPU. On a CPU they run row
chunk by row chunk of about `CPU_PASS_BYTES` (`Ring.pass_bytes`), every pass over one chunk before
the next chunk: a chunk stays in the core's cache between the passes, so a pass after the first
reads cache, not memory. Measured on a 2-core Xeon (one thread): the forward's passes over a 64 MiB
tile 33.5 -> 17.0 ms, the recomputing backward's 24.9 -> 14.3 ms; a ring step (forward and backward)
2-12% faster (`mop bench vocab`, steps of both kinds in turn). The arithmetic per row is the same
either way: results are bit for bit those of whole-tile passes.

Tile buffer. A pass whose tiles are not kept forms every tile, of every block and step, in one fp32
`[block, V/P]` buffer (the GEMM writes into it: `torch.mm(out=)`). On a CPU a 64 MiB tile allocated
per block is, under glibc's default heap (`train.keep_freed_host_memory` off, as the fit leaves it
when memory is tight), a fresh mmap whose pages fault in on the GEMM's first write and are unmapped
on free: measured on the Xeon (one thread, a 1048 x 16000 tile, its GEMM and exponential, 8192
tokens) 0.90 s per pass with a tile per block, 0.64 s with the buffer; under a heap that keeps
freed memory 0.61 and 0.59. A whole ring step (`mop bench vocab`, 8192 tokens per rank, V = 32000)
1.28x faster under the default heap, 1.04x under the keeping one. On a GPU the caching allocator
already hands back the same block; the buffer changes nothing there. Same kernel, same results bit
for bit.

Backward ring: the shards go round again, each with a gradient buffer travelling with it. Per
block the logits are recomputed (or, with `keep_logits`, taken from the forward: the forward keeps
each fp32 tile after its exponential, `e^(z - m)` with `m` its running max, and `m`, a rank's
`[N, V]` in all; the backward then runs two GEMMs per tile instead of three, and one pass
`e^(z - m) e^(m - lse)` instead of the exponential again: the same softmax to fp32 rounding),
`d logits = softmax (1 + 2 z lse) - onehot(target)` (z: the z-loss weight; ignored targets
contribute nothing), the input gradient accumulates locally
(`d logits @ W_j`) and the shard's gradient into its buffer (`d logits^T @ h`). After P steps one
more hop brings every buffer home to its owner, which all-reduces it over its replica group.

Loss: the sum over this rank's targets of `lse - logit_target + z * lse^2`; the trainer divides by
the global target count, so every layout reproduces the single-device loss. A rank whose labels
are all ignored (or that has no tokens) still takes part in both rings. `token_logprobs`: the same
two passes give each token's `logit_target - lse` and take any per-token gradient back (what a
preference loss sums per response), still without full logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mop.config import Config, ConfigError
from mop.models.layers import compute_dtype_of
from mop.models.transformer import IGNORE_INDEX, LMHead
from mop.parallel.comms import wait_for
from mop.parallel.mesh import DistLayout
from mop.parallel.placement import rows_in_part

TILE_BYTES = 64 * 2**20  # default budget of one fp32 logit tile
# A tile's rows per elementwise pass on a CPU: within a core's L2 (1-2 MiB on current server cores). 0.5-1 MiB
# passed equally fast on the Xeon measured, and fewer chunks make fewer Python calls.
CPU_PASS_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class Ring:
    group: dist.ProcessGroup
    replica_group: dist.ProcessGroup | None
    rank: int  # position in the vocabulary group = the shard this rank owns
    size: int
    vocab: int  # true vocabulary size V (rows past it are padding)
    token_block: int
    z_loss: float
    keep_logits: bool = False
    """The forward's tiles stay for the backward (`parallel.vocab_logits = "keep"`)."""
    pass_bytes: int | None = None
    """Bytes of a tile's rows that every elementwise pass covers before the next rows (None: each pass
    over the whole tile, as on a GPU; on a CPU `CPU_PASS_BYTES`, module docstring)."""
    tile_buffer: bool = True
    """A pass that does not keep its tiles forms every one in one fp32 buffer (module docstring); False:
    a tile allocated per block, as the ring did before (`mop bench vocab`'s baseline for the buffer)."""

    def row_chunks(self, tile: torch.Tensor) -> list[slice]:
        """The row chunks of `tile` that its elementwise passes take one after the other."""
        if self.pass_bytes is None:
            return [slice(0, tile.shape[0])]
        return _blocks(tile.shape[0], max(1, self.pass_bytes // (tile.shape[1] * tile.element_size())))

    def valid_columns(self, shard: int, rows: int) -> int:
        """Columns of shard `shard` inside the true vocabulary (a shard of pure padding has none)."""
        return rows_in_part(self.vocab, rows, shard)

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Start sending `tensors` to rank-1 and receiving their successors from rank+1."""
        left = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        right = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        incoming = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, left, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, right, self.group) for t in incoming]
        return incoming, dist.batch_isend_irecv(ops)


def _logits(hidden_block: torch.Tensor, shard: torch.Tensor, valid: int,
            buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 logit tile of `hidden_block` against `shard`, columns from `valid` on masked out; in
    the first rows of `buffer` (`_tile_buffer`) where given, else in a tensor of its own."""
    if buffer is None:
        logits = (hidden_block @ shard.t()).float()
    elif hidden_block.dtype == buffer.dtype:
        logits = torch.mm(hidden_block, shard.t(), out=buffer[:hidden_block.shape[0]])
    else:  # a half-precision product, widened into the buffer as `.float()` would widen it
        logits = buffer[:hidden_block.shape[0]].copy_(hidden_block @ shard.t())
    logits[:, valid:] = float("-inf")
    return logits


def _tile_buffer(ring: Ring, hidden: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The one fp32 `[block, rows]` buffer every tile of a pass is formed in, or None where each tile
    has its own: the ring keeps its tiles (the forward keeps them, the backward takes them), or
    `ring.tile_buffer` is off."""
    if ring.keep_logits or not ring.tile_buffer:
        return None
    return hidden.new_empty((min(ring.token_block, hidden.shape[0]), rows), dtype=torch.float32)


def _blocks(tokens: int, block: int):
    return [slice(start, min(start + block, tokens)) for start in range(0, tokens, block)]


@dataclasses.dataclass
class _Step:
    """One step of a ring pass: the shard held now and what its tiles need; its successor is already
    on its way from rank+1 (`incoming`, `works`)."""

    incoming: list[torch.Tensor] | None
    works: list
    local: torch.Tensor
    """The labels as columns of the shard held now (outside `[0, rows)`: another shard's)."""
    valid_columns: int
    blocks: list[slice]
    """The token blocks to tile (none for a shard of pure padding)."""


def _ring_step(ring: Ring, step: int, shard: torch.Tensor, labels: torch.Tensor) -> _Step:
    """Step `step` of a pass in which this rank starts with its own shard `shard`: sends it on (but
    at the last step) and says which shard it is."""
    j = (ring.rank + step) % ring.size
    rows = shard.shape[0]
    incoming, works = ring.shift([shard]) if step + 1 < ring.size else (None, [])
    valid_columns = ring.valid_columns(j, rows)
    blocks = _blocks(labels.shape[0], ring.token_block) if valid_columns else []
    return _Step(incoming, works, labels - j * rows, valid_columns, blocks)


@dataclasses.dataclass
class _Forward:
    lse: torch.Tensor
    """Each token's fp32 log-sum-exp over the vocabulary."""
    target: torch.Tensor
    """Each token's target logit (0 where the target is ignored)."""
    dtype: torch.dtype
    """The compute dtype the logits ran in."""
    entropy: torch.Tensor | None
    """With `entropy`: each token's entropy `log Z - sum_v p_v (z_v - m)`, `m` the running max (`_fold_entropy`)."""
    kept: deque | None
    """With `ring.keep_logits`: every tile's fp32 `e^(z - m)` and its per-token `m` (the running
    max after it), in the order the backward visits them."""


def _forward_pass(hidden, weight, labels, ring: Ring, entropy: bool = False) -> _Forward:
    """The forward ring (module docstring)."""
    tokens, rows = hidden.shape[0], weight.shape[0]
    # The logits matmul's dtype, as `LMHead`'s `F.linear` would run; autograd runs the backward
    # outside autocast, so the forward's choice is saved and reused there.
    dtype = compute_dtype_of(hidden)
    running_max = hidden.new_full((tokens,), float("-inf"), dtype=torch.float32)
    running_sum = hidden.new_zeros(tokens, dtype=torch.float32)
    target = hidden.new_zeros(tokens, dtype=torch.float32)
    running_weighted = hidden.new_zeros(tokens, dtype=torch.float32) if entropy else None
    # The shard travels in the compute dtype (half the bytes in bf16).
    compute_hidden, shard = hidden.detach().to(dtype), weight.detach().to(dtype)
    kept = deque() if ring.keep_logits else None
    buffer = _tile_buffer(ring, hidden, rows)
    for step in range(ring.size):
        now = _ring_step(ring, step, shard, labels)
        for block in now.blocks:
            logits = _logits(compute_hidden[block], shard, now.valid_columns, buffer)
            mine = (now.local[block] >= 0) & (now.local[block] < rows)
            picked = logits.gather(1, now.local[block].clamp(0, rows - 1).unsqueeze(1)).squeeze(1)
            target[block] = torch.where(mine, picked, target[block])
            new_max, tile_sum, tile_weighted = _exponentiate(logits, running_max[block], ring.row_chunks(logits),
                                                             entropy)
            if kept is not None:  # the tile's e^(z - m) and its m: softmax = e^(z - m) e^(m - lse) in the backward
                kept.append((logits, new_max))
            if entropy:
                running_weighted[block] = _fold_entropy(running_weighted[block], running_sum[block],
                                                        running_max[block], new_max, tile_weighted)
            running_sum[block] = running_sum[block] * torch.exp(running_max[block] - new_max) + tile_sum
            running_max[block] = new_max
            del logits
        wait_for(now.works)
        if now.incoming is not None:
            shard = now.incoming[0]
    lse = running_max + torch.log(running_sum)
    entropies = (torch.log(running_sum) - running_weighted / running_sum) if entropy else None
    return _Forward(lse, target, dtype, entropies, kept)


def _exponentiate(logits: torch.Tensor, old_max: torch.Tensor, chunks: list[slice], entropy: bool):
    """In place on the tile `logits`: each row shifted by its new running max `m` (the larger of
    `old_max` and the row's own) and exponentiated, `e^(z - m)`, chunk of rows by chunk of rows
    (`Ring.row_chunks`). Returns `m`, each row's sum of the tile's `e^(z - m)` and, with `entropy`,
    each row's sum of `e^s s` (`s = z - m`; padding columns' -inf count 0)."""
    new_max, tile_sum = torch.empty_like(old_max), torch.empty_like(old_max)
    tile_weighted = torch.empty_like(old_max) if entropy else None
    for rows in chunks:
        chunk = logits[rows]
        # amax: the max without its indices, several times faster than max(dim) on a CPU; equal values
        new_max[rows] = torch.maximum(old_max[rows], chunk.amax(dim=1))
        chunk.sub_(new_max[rows].unsqueeze(1))
        # With entropy, the shifted logits are kept for it: one more chunk.
        shifted = chunk.masked_fill(torch.isinf(chunk), 0.0) if entropy else None
        # In place on the tile: one [block, V/P] tensor is all a step allocates without entropy.
        tile_sum[rows] = chunk.exp_().sum(dim=1)
        if entropy:
            tile_weighted[rows] = shifted.mul_(chunk).sum(dim=1)
    return new_max, tile_sum, tile_weighted


def _fold_entropy(weighted: torch.Tensor, total: torch.Tensor, old_max: torch.Tensor, new_max: torch.Tensor,
                  tile_weighted: torch.Tensor) -> torch.Tensor:
    """The running `sum_v e^(z_v - m) (z_v - m)` moved from max `old_max` to `new_max` and with the
    tile's sum of `e^s s` added (`tile_weighted`, `s = z - new_max`); `total` is the running
    `sum_v e^(z_v - m)` at the old max. Entropy is then `log total - weighted / total`."""
    step = old_max - new_max
    moved = torch.where(total > 0, (weighted + step * total) * step.exp(), torch.zeros_like(weighted))
    return moved + tile_weighted


def _backward_pass(hidden, weight, labels, lse, ring: Ring, dtype: torch.dtype, softmax_scale: torch.Tensor,
                   target_scale: torch.Tensor, trains: bool, kept: deque | None):
    """The backward ring for per-token gradients `d logits = softmax x softmax_scale - onehot(target)
    x target_scale` (both `[N]` fp32, zero where the target is ignored): the hidden states' gradient
    and, when the projection `trains`, its shard's (all-reduced over the replicas). `kept`: the
    forward's tiles, used (and released) in place of recomputing them."""
    rows = weight.shape[0]
    # Both gradients accumulate in fp32 over the ring's steps (the tiles' products are in the
    # compute dtype, as the reference's matmul is).
    grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
    compute_hidden, shard = hidden.to(dtype), weight.detach().to(dtype)
    # A frozen projection (LoRA's base) gets no gradient: no buffer travels with its shards.
    shard_grad = torch.zeros_like(weight, dtype=torch.float32) if trains else None
    buffer = _tile_buffer(ring, hidden, rows)
    for step in range(ring.size):
        now = _ring_step(ring, step, shard, labels)
        for block in now.blocks:
            if kept is not None:  # one pass over the kept tile: e^(z - m) x e^(m - lse) x scale
                d_logits, tile_max = kept.popleft()
                d_logits.mul_((torch.exp(tile_max - lse[block]) * softmax_scale[block]).unsqueeze(1))
            else:
                d_logits = _logits(compute_hidden[block], shard, now.valid_columns, buffer)
                block_lse, block_scale = lse[block], softmax_scale[block]
                for part in ring.row_chunks(d_logits):
                    d_logits[part].sub_(block_lse[part].unsqueeze(1)).exp_().mul_(block_scale[part].unsqueeze(1))
            # Minus the one-hot target where it lies in this shard (adding 0 elsewhere): no
            # data-dependent shapes, so no device-to-host synchronisation per tile.
            in_shard = (now.local[block] >= 0) & (now.local[block] < rows)
            d_logits.scatter_add_(1, now.local[block].clamp(0, rows - 1).unsqueeze(1),
                                  -(target_scale[block] * in_shard).unsqueeze(1))
            grad_hidden[block] += d_logits.to(dtype) @ shard
            if trains:
                shard_grad.addmm_(d_logits.t(), compute_hidden[block].float())
            del d_logits
        # Done with this shard: drop it before the gradient hop so that only the incoming
        # shard, the gradient and the incoming gradient are in flight.
        del shard
        # The gradient buffer follows its shard; the last hop brings it home to its owner.
        (shard_grad,), grad_works = ring.shift([shard_grad]) if trains else ((None,), [])
        wait_for(now.works + grad_works)
        shard = now.incoming[0] if now.incoming is not None else None
    if trains and ring.replica_group is not None:
        dist.all_reduce(shard_grad, group=ring.replica_group)
    return grad_hidden.to(hidden.dtype), shard_grad.to(weight.dtype) if trains else None


class _RingCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ring: Ring):
        out = _forward_pass(hidden, weight, labels, ring)
        valid = labels != IGNORE_INDEX
        loss = torch.where(valid, out.lse - out.target + ring.z_loss * out.lse.square(), torch.zeros_like(out.lse))
        ctx.save_for_backward(hidden, weight, labels, out.lse)
        ctx.ring, ctx.dtype, ctx.kept = ring, out.dtype, out.kept
        return loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        valid = (labels != IGNORE_INDEX).float() * grad_loss.float()
        scale = (1 + 2 * ctx.ring.z_loss * lse) * valid
        grads = _backward_pass(hidden, weight, labels, lse, ctx.ring, ctx.dtype, scale, valid, ctx.needs_input_grad[1],
                               _take_kept(ctx))
        return *grads, None, None


class _RingTokenLogProbs(torch.autograd.Function):
    """Each token's target log-probability `logit_target - lse` (fp32, 0 where ignored), any
    gradient per token flowing back: what a preference loss sums per response; with `entropy`, each
    token's entropy too (no gradient: a record)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ring: Ring, entropy: bool):
        out = _forward_pass(hidden, weight, labels, ring, entropy)
        ctx.save_for_backward(hidden, weight, labels, out.lse)
        ctx.ring, ctx.dtype, ctx.kept = ring, out.dtype, out.kept
        logps = torch.where(labels != IGNORE_INDEX, out.target - out.lse, torch.zeros_like(out.lse))
        if out.entropy is None:
            return logps
        ctx.mark_non_differentiable(out.entropy)
        return logps, out.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, labels, lse = ctx.saved_tensors
        # d (target - lse) / d logits = onehot - softmax, times each token's incoming gradient
        upstream = torch.where(labels != IGNORE_INDEX, grad_logprobs.float(), torch.zeros_like(lse))
        grads = _backward_pass(hidden, weight, labels, lse, ctx.ring, ctx.dtype, -upstream, -upstream,
                               ctx.needs_input_grad[1], _take_kept(ctx))
        return *grads, None, None, None


def _take_kept(ctx) -> deque | None:
    """The forward's kept tiles, once: the backward consumes them in place, so a second backward
    through the same graph (retain_graph) must not find them."""
    kept, ctx.kept = ctx.kept, None
    if kept is None and ctx.ring.keep_logits:
        raise RuntimeError("the vocabulary ring's kept logits were used by an earlier backward; "
                           "use parallel.vocab_logits=recompute to backpropagate through the loss twice")
    return kept


def default_token_block(shard_rows: int) -> int:
    """Tokens per logit tile so that one fp32 `[block, V/P]` tile is about TILE_BYTES."""
    return max(128, TILE_BYTES // (4 * shard_rows))


class VocabParallelHead(nn.Module):
    """Drop-in `LMHead`: this rank's row shard of the projection and the ring loss."""

    def __init__(self, head: LMHead, layout: DistLayout, token_block: int, z_loss: float, keep_logits: bool):
        super().__init__()
        vocab, hidden = head.weight.shape
        size = layout.layout.vocab
        shard = layout.layout.vocab_shard(layout.rank)
        rows = math.ceil(vocab / size)
        padded = F.pad(head.weight.detach(), (0, 0, 0, rows * size - vocab))
        self.weight = nn.Parameter(padded[shard * rows:(shard + 1) * rows].clone(),
                                   requires_grad=head.weight.requires_grad)
        replicas = layout.vocab_replica_group if layout.layout.vocab_replicas > 1 else None
        self.ring = Ring(layout.vocab_group, replicas, shard, size, vocab, token_block or default_token_block(rows),
                         z_loss, keep_logits, CPU_PASS_BYTES if layout.device.type == "cpu" else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("parallel.vocab > 1 never builds full logits; train with labels (loss_sum), "
                                  "or evaluate logits with parallel.vocab=1")

    def _ring_for(self, h: torch.Tensor) -> Ring:
        """The ring, keeping its tiles only when a backward will use them (not under no_grad: a
        reference forward or an evaluation)."""
        backward = torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad)
        return self.ring if backward or not self.ring.keep_logits else dataclasses.replace(self.ring, keep_logits=False)

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _RingCrossEntropy.apply(h.reshape(-1, h.shape[-1]), self.weight, labels.reshape(-1), self._ring_for(h))

    def token_logprobs(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`LMHead.token_logprobs` over the ring, without full logits."""
        flat = _RingTokenLogProbs.apply(h.reshape(-1, h.shape[-1]), self.weight, labels.reshape(-1),
                                        self._ring_for(h), False)
        return flat.view(labels.shape)

    def token_logprobs_and_entropy(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`LMHead.token_logprobs_and_entropy` over the ring, without full logits."""
        logps, entropy = _RingTokenLogProbs.apply(h.reshape(-1, h.shape[-1]), self.weight, labels.reshape(-1),
                                                  self._ring_for(h), True)
        return logps.view(labels.shape), entropy.view(labels.shape)


def apply_vocab_parallel(model, layout: DistLayout, token_block: int, keep_logits: bool) -> None:
    model.lm_head = VocabParallelHead(model.lm_head, layout, token_block, model.cfg.z_loss_coef, keep_logits)


class TiledHead(LMHead):
    """One vocabulary rank's head without its full logits (`parallel.vocab = 1` with
    `parallel.vocab_logits = "recompute"`): every head method (the loss sum, the per-token log-probs of
    DPO, those and the entropies of RL) runs block by block of `token_block` tokens, each block's
    `[block, V]` logits formed in the forward, dropped, and formed again in the backward (activation
    checkpointing of one block: the ring's trade at P = 1, with no communication). The same
    per-token arithmetic as `LMHead`'s: results differ from it by fp32 rounding only (a GEMM over
    fewer rows may block its sums otherwise; the loss sums the blocks' sums)."""

    def __init__(self, head: LMHead, token_block: int):
        nn.Module.__init__(self)
        self.weight, self.z_loss_coef, self.token_block = head.weight, head.z_loss_coef, token_block

    def _tiled(self, method, h: torch.Tensor, labels: torch.Tensor) -> list:
        """`method(rows, labels)` of each block of tokens, checkpointed."""
        rows, targets = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        return [checkpoint(method, rows[block], targets[block], use_reentrant=False)
                for block in _blocks(rows.shape[0], self.token_block)]

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        blocks = self._tiled(super().loss_sum, h, labels)
        return torch.stack(blocks).sum() if blocks else h.new_zeros((), dtype=torch.float32)

    def token_logprobs(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._tiled(super().token_logprobs, h, labels)).view(labels.shape)

    def token_logprobs_and_entropy(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropy = zip(*self._tiled(super().token_logprobs_and_entropy, h, labels))
        return torch.cat(logps).view(labels.shape), torch.cat(entropy).view(labels.shape)


def tile_vocabulary(model, token_block: int) -> None:
    """Swap one vocabulary rank's head for `TiledHead` (a memory option of every strategy); 0: the
    64 MiB tile's block."""
    model.lm_head = TiledHead(model.lm_head, token_block or default_token_block(model.lm_head.weight.shape[0]))


def check_settings(config: Config, world: int) -> None:
    """The vocabulary ring's own settings: a tile size >= 0, and an output projection of its own."""
    if config.parallel.vocab_token_block < 0:
        raise ConfigError("parallel.vocab_token_block",
                          f"must be >= 0 (0: automatic), got {config.parallel.vocab_token_block}")
    if config.model.tie_embeddings and config.parallel.vocab > 1:
        raise ConfigError("model.tie_embeddings", "tied embeddings need parallel.vocab=1; untie them or set "
                          "--parallel.vocab=1")
