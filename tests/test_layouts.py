"""Every legal layout of 4 ranks trains like the reference: (D, Ep, P) over all divisors of 4, with
LLEP, the host optimizer, activation checkpointing with offload, head-chunked attention and
chunked LLEP each on for some layouts and off for others; losses and gradient norms compared.
The same in bf16 for a subset of layouts, against a bf16 reference.

The layouts run in one set of 4 gloo ranks (one `DistLayout` per layout, the trainer's own
`_train`), which keeps the whole sweep to about a minute on 2 cores.
"""

import itertools

import pytest
import torch

from mop.config import load_config
from mop.parallel import DistLayout, Layout
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import _train
from test_train import TINY, run

# TINY with 4 heads (D=4 needs them), 4 experts (Ep=4) and one sequence per micro-batch (D=1 gives
# each of the 4 data groups one sequence).
FOUR = [*TINY, "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8", "--train.micro_batch=1"]
LAYOUTS = list(itertools.product((1, 2, 4), repeat=3))


def options(index: int, sequence: int, expert: int) -> list[str]:
    """LLEP on every other expert-parallel layout (in 2 chunks on every other of those), the host
    optimizer on every other pair of layouts, activation checkpointing with offload on every third,
    2 attention head chunks on every other sequence-parallel layout that has 2 heads per rank."""
    llep = expert > 1 and index % 2 == 0
    balance = ["--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4", "--parallel.llep_gate=1.0",
               f"--parallel.llep_chunks={1 + (index % 4 == 0)}"] if llep else ["--parallel.expert_balance=ep"]
    memory = ["--train.activation_checkpointing=full", "--train.offload_activations=true"] if index % 3 == 1 else []
    chunks = ["--parallel.attention_head_chunks=2"] if sequence == 2 and index % 2 == 1 else []
    return [*balance, *memory, *chunks, f"--optim.offload={'true' if index % 4 < 2 else 'false'}"]


def layout_args(index: int, sequence: int, expert: int, vocab: int) -> list[str]:
    return ["--parallel.strategy=mop", "--parallel.nproc=4", f"--parallel.sequence={sequence}",
            f"--parallel.expert={expert}", f"--parallel.vocab={vocab}", *options(index, sequence, expert)]


def curves(records):
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _train_layouts(rank, world, base_dir, layouts, extra):
    results = {}
    for index, (sequence, expert, vocab) in layouts:
        args = [*FOUR, *layout_args(index, sequence, expert, vocab), *extra, f"--log.run_dir={base_dir}/{index}"]
        config = settle(load_config(None, args), world, fit_memory=False)
        layout = DistLayout(Layout(world, sequence, expert, vocab), torch.device("cpu"))
        results[(sequence, expert, vocab)] = curves(_train(config, Runtime(rank, world, torch.device("cpu"), layout)))
    return results


@pytest.mark.slow
def test_every_layout_of_four_ranks_matches_the_reference(tmp_path):
    reference_losses, reference_norms = curves(run(tmp_path, "reference", *FOUR[len(TINY):]))
    per_rank = run_distributed(_train_layouts, 4, str(tmp_path), list(enumerate(LAYOUTS)), [], timeout=900)
    results = per_rank[0]
    assert set(results) == set(LAYOUTS)
    for layout, (got_losses, got_norms) in results.items():
        assert got_losses == pytest.approx(reference_losses, rel=1e-4), f"(D, Ep, P) = {layout}"
        assert got_norms == pytest.approx(reference_norms, rel=1e-4), f"(D, Ep, P) = {layout}"


# bf16 layouts, each with the host optimizer (bf16 working weights, fp32 host masters).
BF16_LAYOUTS = [(1, 1, 4), (2, 2, 2), (4, 4, 4), (2, 4, 1), (4, 2, 2), (1, 4, 2)]
BF16 = ["--train.dtype=bfloat16", "--optim.offload=true"]
# Tolerance. Both sides store bf16 weights rounded from the same fp32 masters, compute in bf16
# with fp32 accumulation and reduce gradients in fp32 (FSDP2's reduce dtype, the ring's fp32
# buffers), then keep bf16 gradient shards. A layout changes only the order of fp32 sums and which
# partial sums are rounded to bf16 before they are added (a rank's share of a weight gradient, an
# attention head's output on another rank, a vocabulary shard's logit tile): at most one extra
# bf16 rounding per value, a relative error of 2^-8 (bf16 keeps 8 significant bits). The loss is an
# fp32 mean over tokens of values that carry such errors, and the gradient norm an fp32 norm of
# gradients that do: both are bounded by the same relative 2^-8. An fp32 layout bug is far larger
# (the fp32 sweep above is held to 1e-4).
BF16_RTOL = 2**-8


def check_bf16_mop_layout_against_the_bf16_reference(tmp_path, model: list[str], layout: list[str]) -> None:
    """A family's run (`model` settings) in the mop `layout` against the bf16 reference: losses and
    gradient norms within `BF16_RTOL`."""
    from test_train import losses, run

    reference = run(tmp_path, "reference", *model, *BF16)
    records = run(tmp_path, "mop", *model, *BF16, "--parallel.strategy=mop", *layout)
    assert losses(records) == pytest.approx(losses(reference), rel=BF16_RTOL)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=BF16_RTOL)


@pytest.mark.slow
def test_bf16_layouts_match_the_bf16_reference(tmp_path):
    reference_losses, reference_norms = curves(run(tmp_path, "reference", *FOUR[len(TINY):], *BF16))
    layouts = [(LAYOUTS.index(layout), layout) for layout in BF16_LAYOUTS]
    results = run_distributed(_train_layouts, 4, str(tmp_path), layouts, BF16, timeout=900)[0]
    for layout, (got_losses, got_norms) in results.items():
        assert got_losses == pytest.approx(reference_losses, rel=BF16_RTOL), f"(D, Ep, P) = {layout}"
        assert got_norms == pytest.approx(reference_norms, rel=BF16_RTOL), f"(D, Ep, P) = {layout}"
