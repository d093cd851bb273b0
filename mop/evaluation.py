"""Evaluation: the loss on held-out sequences, under the run's own layout.

Split (`held_out`). With `eval.source` set, the held-out sequences are that corpus, read with
the run's tokenizer and packed to `data.seq_len` as `data.source` is (text or chat, `data.format`).
Otherwise the last `ceil(eval.fraction x N)` of the N packed sequences of `data.source` are held
out and the training stream permutes only the first ones (a text document crossing the boundary
is split between the two, a conversation never is; the stream's sequence count is checkpointed,
so a resume cannot change the split). Each evaluation reads the first `eval.sequences` held-out
sequences, the same ones every time, so points of the curve compare like with like.

Loss (`evaluate`). The mean cross-entropy over every target of those sequences; the router's
auxiliary loss is not part of it. Each data-parallel group takes its contiguous share and its
ranks their slices (`TrainingRun.rank_batches`, as a training step does), forward only, in
micro-batches of `train.micro_batch`. One all-reduce sums the cross-entropy sums and the target
counts over the ranks: the same sums the reference computes in one process, so the loss equals
the reference's up to float reassociation. With the host optimizer the forward first waits for
the last step's updates, as a training forward does (`GradientFeed`); the evaluation's routing
records are dropped, so the next step's expert metrics count training passes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mop.config import Config, ConfigError
from mop.data import (ChatDataset, Data, DataError, PackedDataset, SequenceStream, count_targets, load_dataset,
                      source_options, to_device)
from mop.metrics import drained_metrics
from mop.runtime import sum_over_ranks


@dataclass
class HeldOut:
    """The sequences each evaluation reads: `indices` of `dataset`."""

    dataset: PackedDataset | ChatDataset
    indices: list[int]


def held_out(config: Config, data: Data) -> tuple[Data, HeldOut | None]:
    """The training data (its stream shortened when the held-out split comes from it) and the
    held-out sequences; None without evaluation (`eval.every` = 0)."""
    e = config.eval
    if not e.every:
        return data, None
    if e.source:
        try:
            dataset = load_dataset(e.source, data.tokenizer, config.data.seq_len, config.train.seed,
                                   **source_options(config.data))
        except DataError as err:  # the sources' messages name the setting they read, data.source
            raise DataError(str(err).replace("data.source", "eval.source")) from None
        first, where = 0, "eval.source"
        available = len(dataset)
    else:
        total = data.stream.num_sequences
        available = math.ceil(e.fraction * total)
        dataset, first, where = data.dataset, total - available, "the held-out eval.fraction"
        if available >= total:
            raise DataError(f"eval.fraction: holding out {available} of data.source's {total} sequences leaves none "
                            "to train on; lower eval.fraction or add data")
        stream = data.stream
        data = data._replace(stream=SequenceStream(first, stream.seed, stream.seq_len, stream.fingerprint))
    if available < e.sequences:
        raise DataError(f"eval.sequences: {e.sequences} sequences are asked for but {where} holds {available} "
                        f"sequences of {config.data.seq_len} tokens; lower eval.sequences, or raise eval.fraction "
                        "or add data")
    return data, HeldOut(dataset, list(range(first, first + e.sequences)))


def evaluate(run) -> float:
    """The mean held-out cross-entropy of `run` (a `mop.build.TrainingRun`; collective over all ranks)."""
    runtime = run.runtime
    batches = run.rank_batches(run.held_out.indices, run.held_out.dataset)
    ce_sum = torch.zeros((), dtype=torch.float64, device=runtime.device)
    run.optimizer.before_forward()  # host: the blocks wait for their own updates in their forward pre-hooks
    with torch.no_grad(), run.autocast():
        for batch in batches:
            batch = to_device(batch, runtime.device)
            terms = run.model.loss_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                         batch["document_ids"], batch.get("padding"), mtp=False)
            ce_sum += terms.ce_sum.double()
    drained_metrics(run.model)  # the held-out forwards are no training step's routing
    ce, count = sum_over_ranks([ce_sum.item(), count_targets(batches)], runtime)
    return ce / count


def check_settings(config: Config, world: int) -> None:
    """The held-out share, and evaluation batches that split over the data groups like training's."""
    e, t = config.eval, config.train
    unit = world // config.parallel.sequence * t.micro_batch
    if not 0 < e.fraction < 1:
        raise ConfigError("eval.fraction", f"must be in (0, 1), got {e.fraction}")
    if e.every and e.sequences % unit:
        raise ConfigError("eval.sequences", f"{e.sequences} must be a multiple of data groups x train.micro_batch "
                          f"({unit}); e.g. {max(1, e.sequences // unit) * unit}")
