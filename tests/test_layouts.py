"""Every legal layout of 4 ranks trains like the reference: (D, Ep, P) over all divisors of 4, with
LLEP and the host optimizer each on for some layouts and off for others.

The 27 layouts run in one set of 4 gloo ranks (one `DistLayout` per layout, the trainer's own
`_train`), which keeps the whole sweep to about a minute on 2 cores.
"""

import itertools

import pytest
import torch

from mop.config import load_config, validate
from mop.parallel import DistLayout, Layout
from mop.testing import run_distributed
from mop.train import Runtime, _train
from test_train import TINY, losses, run

# TINY with 4 heads (D=4 needs them), 4 experts (Ep=4) and one sequence per micro-batch (D=1 gives
# each of the 4 data groups one sequence).
FOUR = [*TINY, "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8", "--train.micro_batch=1"]
LAYOUTS = list(itertools.product((1, 2, 4), repeat=3))


def options(index: int, expert: int) -> list[str]:
    """LLEP on every other expert-parallel layout, the host optimizer on every other pair of layouts."""
    llep = expert > 1 and index % 2 == 0
    balance = ["--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4", "--parallel.llep_gate=1.0"] if llep \
        else ["--parallel.expert_balance=ep"]
    return [*balance, f"--optim.offload={'true' if index % 4 < 2 else 'false'}"]


def layout_args(index: int, sequence: int, expert: int, vocab: int) -> list[str]:
    return ["--parallel.strategy=mop", "--parallel.nproc=4", f"--parallel.sequence={sequence}",
            f"--parallel.expert={expert}", f"--parallel.vocab={vocab}", *options(index, expert)]


def _every_layout(rank, world, base_dir):
    results = {}
    for index, (sequence, expert, vocab) in enumerate(LAYOUTS):
        args = [*FOUR, *layout_args(index, sequence, expert, vocab), f"--log.run_dir={base_dir}/{index}"]
        config = validate(load_config(None, args), world)
        layout = DistLayout(Layout(world, sequence, expert, vocab), torch.device("cpu"))
        results[(sequence, expert, vocab)] = losses(_train(config, Runtime(rank, world, torch.device("cpu"), layout)))
    return results


@pytest.mark.slow
def test_every_layout_of_four_ranks_matches_the_reference(tmp_path):
    reference = losses(run(tmp_path, "reference", *FOUR[len(TINY):]))
    per_rank = run_distributed(_every_layout, 4, str(tmp_path), timeout=600)
    results = per_rank[0]
    assert set(results) == set(LAYOUTS)
    for layout, got in results.items():
        assert got == pytest.approx(reference, rel=1e-4), f"(D, Ep, P) = {layout}"
