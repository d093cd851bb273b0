"""The reference log-probs of a DPO run without a base to switch to: computed once, before the first
step, from the starting weights, in the run's own layout, and stored beside the run
(`mop.objectives.reference_table`: where, its identity, the checks).

What (`compute`): every packed sequence of the data once, in the global batches of the first epoch's
steps (the data stream's order, each step's micro-batches split over the ranks as a training step
splits them, `TrainingRun.rank_batches`), a forward under no_grad in the run's compute dtype (LoRA:
with its adapters off); each response's summed target log-probs
(`MoETransformer.preference_terms`). The first rank of each sequence group writes its sequences'
pairs into a `[pairs, 2]` float64 table by corpus item (`PreferenceDataset.pairs_of`) and one
all-reduce over the world gives every rank the whole table. The last batch runs whole, the next
epoch's first sequences included, whose results are dropped. So the first step's reference sums
are its policy's, bit for bit, whatever the layout: the same rows through the same kernels in the
same micro-batches (a row's rounding depends on what shares its micro-batch: GEMM blocking, the
tokens each expert gets); its rewards are exactly 0 and rewards/accuracies 0, as TRL's. Later
steps use other weights, and a later epoch packs a sequence beside others.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mop.build import TrainingRun
from mop.data import to_device
from mop.models.lora import adapters_disabled
from mop.objectives import reference_table
from mop.objectives.preference.step import PreferenceLoss


def attach(run: TrainingRun, run_dir: Path, meta: dict | None) -> dict:
    """The run's precomputed reference sums attached to its data (`reference_table.attach`)."""
    return reference_table.attach(run, run_dir, meta, "dpo", compute)


@torch.no_grad()
def compute(run: TrainingRun) -> np.ndarray:
    """The `[pairs, 2]` float64 table of the starting weights' summed log-probs (module docstring)."""
    config, runtime, dataset = run.config, run.runtime, run.data.dataset
    count, d, size = len(dataset), config.parallel.sequence, config.train.global_batch
    table = torch.zeros(dataset.corpus_pairs, 2, dtype=torch.float64)
    objective = PreferenceLoss(run.model, config.dpo, None, dataset.pairs_max)
    leader = runtime.rank % d == 0  # the D ranks of a sequence group hold the same sums
    adapters_off = adapters_disabled(run.model) if config.adapters is not None else nullcontext()
    with adapters_off, run.autocast():
        for start in range(0, count, size):
            # the global batch the step at `start` trains, in its micro-batches: the first step's sums are
            # then the policy's own, bit for bit (the same kernels over the same rows)
            order = run.data.stream.indices(start, size)
            batches = run.rank_batches(order, dataset)
            for batch, rows in zip(batches, run.rank_indices(list(enumerate(order, start)))):
                logps = objective.terms(to_device(batch, runtime.device)).logps.double().cpu()
                for row, (position, sequence) in enumerate(rows):
                    if leader and position < count:  # the first epoch's: a sequence the last batch repeats is not
                        items = torch.as_tensor(dataset.pairs_of(sequence))
                        table[items] = logps.view(len(rows), dataset.pairs_max, 2)[row, :len(items)]
    if runtime.layout is not None:
        table = table.to(runtime.device)
        dist.all_reduce(table, group=runtime.layout.world_group)
    return table.cpu().numpy()
