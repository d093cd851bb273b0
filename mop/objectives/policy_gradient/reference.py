"""The KL's reference log-probs of a policy-gradient run without a base to switch to (full
fine-tuning): computed once, before the first step, from the starting weights, in the run's own
layout, and stored beside the run (`mop.objectives.reference_table`: where, its identity, the checks).

What (`compute`): every packed sequence of the data once, in the global batches of the first epoch's
steps (the data stream's order, each step's micro-batches split over the ranks as a training step
splits them, `TrainingRun.rank_batches`), a forward under no_grad in the run's compute dtype with
the step's routing replay (the rollouts' routes, R3; R2 replays nothing on a batch's first step);
each position's log-prob of its label (`MoETransformer.policy_terms`). Each rank writes its slice of
its sequences into a `[sequences, seq_len]` float32 table (a sequence group's ranks hold distinct
slices, data groups distinct sequences) and one all-reduce over the world gives every rank the whole
table (4 bytes per packed token, in host memory). The last batch runs whole, the next epoch's first
sequences included, whose results are dropped. So the first step's reference log-probs are its
policy's, bit for bit, whatever the layout (the same rows through the same kernels in the same
micro-batches): its `kl` is exactly 0. The packed sequences are the table's rows, so the identity's
data fingerprint (`RolloutDataset.fingerprint`: the rollouts, seq_len and seed) names the packing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mop.build import TrainingRun
from mop.data import to_device
from mop.objectives import reference_table


def attach(run: TrainingRun, run_dir: Path, meta: dict | None, replay: bool) -> dict:
    """The run's precomputed reference log-probs attached to its data (`reference_table.attach`);
    `replay`: the rollouts' routes replayed (R3)."""
    return reference_table.attach(run, run_dir, meta, "rl", lambda run: compute(run, replay))


def compute(run: TrainingRun, replay: bool) -> np.ndarray:
    """The `[sequences, seq_len]` float32 table of the starting weights' per-position log-probs of
    their labels (0 where none; module docstring)."""
    return token_tables(run, replay)[0]


@torch.no_grad()
def token_tables(run: TrainingRun, replay: bool, entropy: bool = False) -> list[np.ndarray]:
    """The `[sequences, seq_len]` float32 table of the run's current weights' per-position log-probs
    of their labels and, with `entropy`, the table of their entropies (0 where no label; module
    docstring), on every rank: what the reference precomputes and `mop.trainer.Trainer.log_probs`
    returns."""
    config, runtime, dataset = run.config, run.runtime, run.data.dataset
    count, size, d = len(dataset), config.train.global_batch, config.parallel.sequence
    width = config.data.seq_len // d
    first = runtime.rank % d * width  # this rank's slice of each sequence
    table = torch.zeros(1 + entropy, count, config.data.seq_len)  # log-probs (, entropies)
    with run.autocast():
        for start in range(0, count, size):
            # the global batch the step at `start` trains, in its micro-batches: the first step's
            # log-probs are then the policy's own, bit for bit
            order = run.data.stream.indices(start, size)
            for batch, rows in zip(run.rank_batches(order, dataset), run.rank_indices(list(enumerate(order, start)))):
                batch = to_device(batch, runtime.device)
                terms = run.model.policy_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                               batch["document_ids"], batch.get("padding"),
                                               batch.get("routes") if replay else None)
                values = torch.stack([terms.logps.float(), terms.entropy.float()][:1 + entropy]).cpu()
                for row, (position, sequence) in enumerate(rows):
                    if position < count:  # the first epoch's: a sequence the last batch repeats is not
                        table[:, sequence, first:first + width] = values[:, row]
    if runtime.layout is not None:
        table = table.to(runtime.device)
        dist.all_reduce(table, group=runtime.layout.world_group)
    return list(table.cpu().numpy())
