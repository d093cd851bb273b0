"""The vocabulary-parallel ring cross-entropy against `F.cross_entropy` on full logits.

Each rank holds its own hidden states and targets (a different number of tokens per rank, one
rank with every target ignored); the loss summed over ranks, each rank's hidden-state gradient
and the gathered weight gradient must match the single-process computation. Every rank runs the
ring twice, recomputing its logit tiles in the backward and keeping them from the forward
(`parallel.vocab_logits`): the forward's results are the same bit for bit, the gradients to fp32
rounding (the kept softmax is `e^(z - m) e^(m - lse)`, the recomputed `e^(z - lse)`).
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.transformer import IGNORE_INDEX, LMHead
from mop.parallel import DistLayout, Layout
from mop.parallel.vocab import CPU_PASS_BYTES, Ring, VocabParallelHead
from mop.testing import rank_device, run_distributed
from conftest import devices, to_cpu

HIDDEN = 16


def rank_tokens(world: int) -> list[int]:
    return [5 + 3 * r for r in range(world)]  # different N per rank


def problem(world: int, vocab: int, z_loss: float):
    g = torch.Generator().manual_seed(vocab + world)
    head = LMHead(ModelConfig(vocab_size=vocab, hidden=HIDDEN, z_loss_coef=z_loss))
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    hidden, labels = [], []
    for r, n in enumerate(rank_tokens(world)):
        hidden.append(torch.randn(n, HIDDEN, generator=g))
        target = torch.randint(0, vocab, (n,), generator=g)
        target[::3] = IGNORE_INDEX
        if r == 1:
            target[:] = IGNORE_INDEX  # a rank whose targets are all ignored
        labels.append(target)
    return head, hidden, labels


def both_ways(rank_step, forward_values: int) -> tuple:
    """`rank_step(keep_logits)`'s results (its first `forward_values` the forward's, then gradients)
    with the tiles recomputed; asserts that keeping them gives the forward's bit for bit and the
    gradients to fp32 rounding."""
    recomputed, kept = rank_step(False), rank_step(True)
    for i, (a, b) in enumerate(zip(recomputed, kept)):
        forward = i < forward_values
        assert_close(b, a, atol=0 if forward else 1e-6, rtol=0 if forward else 1e-6)
    return recomputed


def vocab_rank(rank, world, vocab_size, vocab, token_block, z_loss):
    device = rank_device()
    layout = DistLayout(Layout(world, vocab=vocab), device)
    head, hidden, labels = problem(world, vocab_size, z_loss)

    def step(keep_logits: bool):
        parallel = VocabParallelHead(head, layout, token_block, z_loss, keep_logits).to(device)
        h = hidden[rank].to(device).clone().requires_grad_()  # a leaf of its own per run
        loss = parallel.loss_sum(h, labels[rank].to(device))
        (2.0 * loss).backward()
        return to_cpu((loss.detach(), h.grad, parallel.weight.grad, layout.layout.vocab_shard(rank)))

    return both_ways(step, forward_values=1)


CASES = [(2, 2, 12, 0), (2, 2, 13, 4), (4, 4, 13, 2), pytest.param(4, 4, 6, 0, marks=pytest.mark.slow),
         pytest.param(4, 2, 11, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("device", devices(4))
@pytest.mark.parametrize("world, vocab, vocab_size, token_block", CASES)
@pytest.mark.parametrize("z_loss", [0.0, 0.1])
def test_ring_loss_matches_full_logits(world, vocab, vocab_size, token_block, z_loss, device):
    # token_block 0: the automatic size, which here covers all of a rank's tokens in one tile.
    results = run_distributed(vocab_rank, world, vocab_size, vocab, token_block, z_loss, device=device)
    head, hidden, labels = problem(world, vocab_size, z_loss)
    h = torch.cat(hidden).requires_grad_()
    target = torch.cat(labels)
    logits = F.linear(h, head.weight)
    loss = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    kept = target != IGNORE_INDEX
    loss = loss + z_loss * torch.logsumexp(logits[kept], dim=-1).square().sum()
    (2.0 * loss).backward()
    assert_close(sum(r[0] for r in results), loss.detach(), atol=1e-5, rtol=1e-6)
    offsets = [0, *torch.tensor(rank_tokens(world)).cumsum(0).tolist()]
    rows = math.ceil(vocab_size / vocab)
    padded_grad = F.pad(head.weight.grad, (0, 0, 0, rows * vocab - vocab_size))
    for rank, (_, h_grad, w_grad, shard) in enumerate(results):
        assert_close(h_grad, h.grad[offsets[rank]:offsets[rank + 1]], atol=1e-5, rtol=1e-5)
        assert_close(w_grad, padded_grad[shard * rows:(shard + 1) * rows], atol=1e-5, rtol=1e-5)
    assert results[1][1].abs().sum() == 0  # the all-ignored rank gets no input gradient


def logprob_rank(rank, world, vocab_size, vocab, token_block):
    device = rank_device()
    layout = DistLayout(Layout(world, vocab=vocab), device)
    head, hidden, labels = problem(world, vocab_size, 0.0)

    def step(keep_logits: bool):
        parallel = VocabParallelHead(head, layout, token_block, 0.0, keep_logits).to(device)
        h = hidden[rank].to(device).clone().requires_grad_()  # a leaf of its own per run
        logprobs = parallel.token_logprobs(h, labels[rank].to(device))
        weights = torch.arange(1, h.shape[0] + 1, dtype=torch.float32, device=device)  # a gradient per token
        (logprobs * weights).sum().backward()
        return to_cpu((logprobs.detach(), h.grad, parallel.weight.grad, layout.layout.vocab_shard(rank)))

    return both_ways(step, forward_values=1)


@pytest.mark.parametrize("world, vocab, vocab_size, token_block", [(2, 2, 12, 0), (4, 4, 13, 2)])
def test_ring_token_logprobs_match_full_logits(world, vocab, vocab_size, token_block):
    """Each token's target log-probability from the ring equals `LMHead.token_logprobs` (0 where
    ignored), and a different gradient per token flows back to the hidden states and the shards."""
    results = run_distributed(logprob_rank, world, vocab_size, vocab, token_block)
    head, hidden, labels = problem(world, vocab_size, 0.0)
    h = torch.cat(hidden).requires_grad_()
    want = head.token_logprobs(h, torch.cat(labels))
    weights = torch.cat([torch.arange(1, n + 1, dtype=torch.float32) for n in rank_tokens(world)])
    (want * weights).sum().backward()
    offsets = [0, *torch.tensor(rank_tokens(world)).cumsum(0).tolist()]
    rows = math.ceil(vocab_size / vocab)
    padded_grad = F.pad(head.weight.grad, (0, 0, 0, rows * vocab - vocab_size))
    for rank, (logprobs, h_grad, w_grad, shard) in enumerate(results):
        mine = slice(offsets[rank], offsets[rank + 1])
        assert_close(logprobs, want.detach()[mine], atol=1e-5, rtol=1e-5)
        assert_close(h_grad, h.grad[mine], atol=1e-5, rtol=1e-5)
        assert_close(w_grad, padded_grad[shard * rows:(shard + 1) * rows], atol=1e-5, rtol=1e-5)
    assert (results[1][0] == 0).all()  # the all-ignored rank


def entropy_rank(rank, world, vocab_size, vocab, token_block):
    device = rank_device()
    layout = DistLayout(Layout(world, vocab=vocab), device)
    head, hidden, labels = problem(world, vocab_size, 0.0)

    def step(keep_logits: bool):
        parallel = VocabParallelHead(head, layout, token_block, 0.0, keep_logits).to(device)
        h = hidden[rank].to(device).clone().requires_grad_()  # a leaf of its own per run
        logprobs, entropy = parallel.token_logprobs_and_entropy(h, labels[rank].to(device))
        logprobs.sum().backward()
        return to_cpu((logprobs.detach(), entropy, h.grad))

    return both_ways(step, forward_values=2)


@pytest.mark.parametrize("world, vocab, vocab_size, token_block", [(2, 2, 12, 0), (4, 4, 13, 2)])
def test_ring_entropy_matches_full_logits(world, vocab, vocab_size, token_block):
    """Each token's entropy from the ring (no full logits; a shard of padding columns included)
    equals the entropy of its full next-token distribution, and equals the head's; the log-probs
    and their gradient are those of `token_logprobs`."""
    results = run_distributed(entropy_rank, world, vocab_size, vocab, token_block)
    head, hidden, labels = problem(world, vocab_size, 0.0)
    h = torch.cat(hidden).requires_grad_()
    logits = head(h).detach()
    want = torch.distributions.Categorical(logits=logits).entropy()
    logprobs, entropy = head.token_logprobs_and_entropy(h, torch.cat(labels))
    assert_close(entropy, want, atol=1e-5, rtol=1e-5)
    logprobs.sum().backward()
    offsets = [0, *torch.tensor(rank_tokens(world)).cumsum(0).tolist()]
    for rank, (ring_logprobs, ring_entropy, h_grad) in enumerate(results):
        mine = slice(offsets[rank], offsets[rank + 1])
        assert_close(ring_entropy, want[mine], atol=1e-5, rtol=1e-5)
        assert_close(ring_logprobs, logprobs.detach()[mine], atol=1e-5, rtol=1e-5)
        assert_close(h_grad, h.grad[mine], atol=1e-5, rtol=1e-5)


def test_head_token_logprobs_are_the_negative_cross_entropy():
    head, hidden, labels = problem(1, 11, 0.0)
    logprobs = head.token_logprobs(hidden[0], labels[0])
    kept = labels[0] != IGNORE_INDEX
    assert_close(-logprobs.sum(), head.loss_sum(hidden[0], labels[0]), atol=1e-5, rtol=1e-6)
    assert (logprobs[~kept] == 0).all() and (logprobs[kept] < 0).all()


def test_full_logits_are_refused():
    with pytest.raises(NotImplementedError, match="parallel.vocab"):
        VocabParallelHead.forward(None, torch.zeros(1))


def kept_tiles_rank(rank, world):
    """What the kept ring holds: its tiles while a backward is due, none under no_grad, and none
    after the backward has used them (a second backward is refused in one line)."""
    layout = DistLayout(Layout(world, vocab=world), torch.device("cpu"))
    head, hidden, labels = problem(world, 12, 0.0)
    parallel = VocabParallelHead(head, layout, 2, 0.0, keep_logits=True)
    h = hidden[rank].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = parallel.loss_sum(h, labels[rank])
    kept = len(loss.grad_fn.kept)
    with torch.no_grad():
        assert not parallel._ring_for(h).keep_logits
    loss.backward(retain_graph=True)
    left = loss.grad_fn.kept
    try:
        loss.backward()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return kept, left, refused


def test_the_kept_ring_holds_every_tile_until_its_backward_and_no_more():
    for rank, (kept, left, refused) in enumerate(run_distributed(kept_tiles_rank, 2)):
        assert kept == 2 * -(-rank_tokens(2)[rank] // 2)  # P shards x the rank's blocks of 2 tokens
        assert left is None and "parallel.vocab_logits=recompute" in refused


def ring_results(parallel: VocabParallelHead, hidden: torch.Tensor, labels: torch.Tensor) -> tuple:
    """The loss and both gradients of one step of `parallel` on a copy of `hidden`, then its log-probs
    and entropies."""
    h = hidden.clone().requires_grad_()
    loss = parallel.loss_sum(h, labels)
    loss.backward()
    return loss.detach(), h.grad, parallel.weight.grad, *parallel.token_logprobs_and_entropy(h.detach(), labels)


def pass_chunks_rank(rank, world):
    """Every ring result twice: each elementwise pass over one row of a tile at a time, and over the
    whole tile."""
    layout = DistLayout(Layout(world, vocab=world), torch.device("cpu"))
    head, hidden, labels = problem(world, 13, 0.1)
    results = {}
    for pass_bytes in (1, None):
        for keep_logits in (False, True):
            parallel = VocabParallelHead(head, layout, 4, 0.1, keep_logits)
            assert parallel.ring.pass_bytes == CPU_PASS_BYTES  # a CPU layout's
            parallel.ring = dataclasses.replace(parallel.ring, pass_bytes=pass_bytes)
            results[pass_bytes, keep_logits] = ring_results(parallel, hidden[rank], labels[rank])
    chunks = parallel.ring.row_chunks(torch.zeros(5, 7))
    return results, chunks


def test_cache_sized_passes_give_the_whole_tile_passes_results_bit_for_bit():
    """On a CPU a tile's elementwise passes run row chunk by row chunk (`Ring.pass_bytes`); with one
    row per chunk the loss, both gradients, the log-probs and the entropies are those of passes over
    the whole tile, bit for bit, recomputing the tiles and keeping them."""
    for results, whole_tile_chunks in run_distributed(pass_chunks_rank, 2):
        assert whole_tile_chunks == [slice(0, 5)]
        for keep_logits in (False, True):
            for chunked, whole in zip(results[1, keep_logits], results[None, keep_logits]):
                assert torch.equal(chunked, whole)


def test_a_tiles_row_chunks_hold_about_the_pass_bytes():
    ring = Ring(None, None, 0, 1, 10, 4, 0.0, pass_bytes=3 * 7 * 4)
    assert ring.row_chunks(torch.zeros(8, 7)) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert dataclasses.replace(ring, pass_bytes=1).row_chunks(torch.zeros(2, 7)) == [slice(0, 1), slice(1, 2)]


def tile_buffer_rank(rank, world):
    """Every result of a recomputing ring twice, in fp32 and in bf16: each tile formed in the pass's
    one buffer, and each in a tensor of its own."""
    layout = DistLayout(Layout(world, vocab=world), torch.device("cpu"))
    head, hidden, labels = problem(world, 13, 0.1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tile_buffer in (True, False):
            parallel = VocabParallelHead(head, layout, 4, 0.1, keep_logits=False).to(dtype)
            assert parallel.ring.tile_buffer  # as the ring runs
            parallel.ring = dataclasses.replace(parallel.ring, tile_buffer=tile_buffer)
            results[dtype, tile_buffer] = ring_results(parallel, hidden[rank].to(dtype), labels[rank])
    return results


def test_tiles_formed_in_one_buffer_give_the_results_of_a_tile_per_block_bit_for_bit():
    """A recomputing ring forms every tile of a pass in one buffer (`Ring.tile_buffer`): the loss, both
    gradients, the log-probs and the entropies are those of a tile allocated per block, bit for bit,
    in fp32 (the GEMM writes into the buffer) and in bf16 (the product widened into it)."""
    for results in run_distributed(tile_buffer_rank, 2):
        for dtype in (torch.float32, torch.bfloat16):
            for buffered, own in zip(results[dtype, True], results[dtype, False], strict=True):
                assert buffered.dtype == own.dtype and torch.equal(buffered, own)
