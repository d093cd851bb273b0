"""The trainer an RL framework drives (verl's training engine, slime's actor), on every rank: the
same run, objective and step `mop train` runs (`mop.build.build_run`, `mop.train.run_step`), with
batches of rollout rows handed in instead of read from data.source.

    trainer = Trainer(config)                 # under torchrun: joins the ranks, settles, builds the run
    trainer.log_probs(rows)                   # each row's completion tokens' log-probs and entropies
    records = trainer.train(rows)             # rl.updates_per_batch optimizer steps on the rows
    for bucket in trainer.weights():          # the weights for the engine, rank 0's buckets (or as published)
        engine_update(bucket)
    trainer.send_weights(sender)              # or to vLLM or SGLang over their weight-update APIs (mop.rl.senders)
    trainer.save(); trainer.load(path)        # checkpoints any layout reads
    trainer.sleep(); trainer.wake()           # device memory released and restored between phases

Rows are `data.format = "rollouts"` rows (`mop.data.rollouts.rows`: token ids or messages, sampling
log-probs, an advantage or a reward with a group, routed experts), the same global batch on every
rank; each rank keeps its share as a step does (`TrainingRun.rank_batches`). They are packed as
recorded rollouts, padded to `train.global_batch` sequences (`mop.rl.feed.rollout_batch`); a row that
does not fit `data.seq_len`, or is invalid, is a one-line `DataError`.

`log_probs` runs the forward of the packed batch under no_grad in the run's layout, the rows' routes
replayed when they carry them and `rl.replay` allows (`token_tables`: each rank's slice of its
sequences, one all-reduce), and cuts each row's values out of its packed sequence. `train` runs
`rl.updates_per_batch` steps (the first one's log-probs are the old ones of the later ones) and
returns their records; the learning-rate schedule counts the trainer's steps against `train.steps`.

`sleep`/`wake` hold nothing on a CPU run (the host is its device). On CUDA they are not implemented
(`NotImplementedError`): moving FSDP2's shards and the optimizer's state off the GPU and back has not
been built and measured on one.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from mop import checkpoint
from mop.build import build_run
from mop.config import Config
from mop.data import DataError
from mop.metrics import peak_memory_bytes
from mop.models.hf import AsPublished, HFWeights
from mop.objectives import objective_for
from mop.objectives.policy_gradient.reference import token_tables
from mop.rl.feed import BatchData, rollout_batch, write_rows
from mop.rl.weights import Bucket, weight_buckets
from mop.run_dir import shared_run_dir
from mop.runtime import Runtime
from mop.train import run_step, save, setup_runtime, start_from, take_origin, worst_rank_state


class HandedRows(BatchData):
    """A trainer's data: the batch of rows handed in last (`take`), served whole as one global batch."""

    def __init__(self, config: Config):
        super().__init__(config)
        self._folder = tempfile.TemporaryDirectory(prefix="mop-rows-")

    def take(self, rows: list[dict]) -> None:
        path = Path(self._folder.name) / "rows.jsonl"
        write_rows(path, rows)
        try:
            dataset = rollout_batch(self.config, self.tokenizer, path)
        except DataError as err:  # named by the temporary file: name the caller's rows instead
            raise DataError(str(err).replace(f"data.source: {path} row", "the trainer's rows: row")) from None
        if dataset.packing.dropped:
            raise DataError(f"data.seq_len: {dataset.packing.dropped} of the {len(rows)} rows are longer than "
                            f"{self.config.data.seq_len} tokens; raise data.seq_len")
        self._dataset = dataset

    @property
    def dataset(self):
        if self._dataset is None:
            raise RuntimeError("the trainer has no rows yet: hand a batch to train() or log_probs()")
        return self._dataset

    def next_batch(self, size: int) -> list[int]:
        self.position += size
        return list(range(size))

    def indices(self, start: int, count: int) -> list[int]:
        return list(range(count))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def close(self) -> None:
        self._folder.cleanup()


class Trainer:
    """The RL framework's trainer on this rank (module docstring). `runtime`: where this process sits
    when the caller has joined the ranks itself (`config` then settled for its world); None: joined
    here (under torchrun) and settled."""

    def __init__(self, config: Config, runtime: Runtime | None = None):
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, format="rollouts"))
        self._joined = runtime is None
        if runtime is None:
            config, runtime = setup_runtime(config)
        before = peak_memory_bytes(runtime.device)
        self.config, self.runtime = config, runtime
        self.run_dir = shared_run_dir(config, runtime)
        self.data = HandedRows(config)
        self.run = build_run(config, runtime, self.data)
        self.state_memory = worst_rank_state(self.run, before)
        self.step = 0
        if config.checkpoint.init:
            take_origin(self.run, start_from(self.run, Path(config.checkpoint.init)))

    def log_probs(self, rows: list[dict]) -> list[dict]:
        """Each row's `logps` and `entropy` (float32 arrays, one value per completion token trained:
        the generated ones) under the current weights, on every rank (module docstring)."""
        self.data.take(rows)
        self.run.optimizer.synchronize()  # the host optimizer's last updates, in the weights
        replay = objective_for(self.run).replay == "rollout"
        logps, entropy = token_tables(self.run, replay, entropy=True)
        dataset, packing = self.data.dataset, self.data.dataset.packing
        values: list[dict] = [{} for _ in rows]
        for sequence in range(len(dataset)):
            slots = dataset[sequence]["rollout_ids"].numpy()
            for slot, item in enumerate(packing.items[packing.bounds[sequence]:packing.bounds[sequence + 1]]):
                taken = slots == slot
                values[item] = {"logps": logps[sequence][taken], "entropy": entropy[sequence][taken]}
        return values

    def train(self, rows: list[dict]) -> list[dict]:
        """`rl.updates_per_batch` optimizer steps on `rows`; their records (as `mop train` writes them)."""
        self.data.take(rows)
        objective, run = objective_for(self.run), self.run
        batches = run.next_batches()
        records = []
        for _ in range(objective.updates_per_batch):
            records.append(run_step(run, self.step, lambda: batches, objective, self.state_memory))
            self.step += 1
        return records

    def weights(self, bucket_mb: int | None = None, dtype: torch.dtype = torch.bfloat16,
                published: str | Path | None = None) -> Iterator[Bucket]:
        """The weights for the engine in `dtype`, in buckets of `bucket_mb` MiB (None: `rl.sync_bucket_mb`) on
        rank 0, in the hub layout (`mop.rl.weights.weight_buckets`); every rank iterates them to the end.
        `published`: the Hugging Face folder the weights were imported from (`mop convert from-hf`), whose
        format they are sent in (its fp8 blocks or MXFP4 experts re-quantized, its dtypes)."""
        form = None
        if published is not None:
            with HFWeights(Path(published)) as base:
                form = AsPublished(base)
        return weight_buckets(self.run, (bucket_mb or self.config.rl.sync_bucket_mb) << 20, dtype, form)

    def send_weights(self, sender, weight_version: str | None = None, **export) -> None:
        """The weights to a running engine through `sender` (`mop.rl.senders`, made and connected on rank 0
        only; None elsewhere): rank 0 sends the buckets of `weights(**export)`, the other ranks take their
        part in gathering them; collective."""
        buckets = self.weights(**export)
        if sender is not None:
            sender.send(buckets, weight_version)
        for _ in buckets:  # the other ranks' part (rank 0's sender took every bucket)
            pass

    def save(self) -> Path:
        """A checkpoint of the trainer's step (`<run dir>/checkpoints/step_<N>`), collective."""
        return save(self.run, self.run_dir, self.step)

    def load(self, path: str | Path) -> None:
        """The weights, optimizer state and step of checkpoint `path` (any layout's), collective."""
        path = Path(path)
        meta = checkpoint.read_meta(path)
        checkpoint.check_compatible(meta, self.config, path)
        checkpoint.load(path, self.run.model, self.run.optimizer, self.run.views, meta=meta)
        take_origin(self.run, meta)
        self.step = meta["step"]

    def sleep(self) -> None:
        """Release the device memory the trainer holds while the engine generates (module docstring)."""
        self._device_memory("sleep")

    def wake(self) -> None:
        """Take back what `sleep` released."""
        self._device_memory("wake")

    def _device_memory(self, phase: str) -> None:
        if self.runtime.device.type != "cpu":
            raise NotImplementedError(f"Trainer.{phase} on {self.runtime.device.type}: releasing the device memory "
                                      "of FSDP2's shards and the optimizer between phases is not implemented")

    def close(self) -> None:
        """End the run's threads and, if the trainer joined the ranks, leave the process group."""
        self.run.close()
        if self._joined and self.runtime.layout is not None:
            dist.destroy_process_group()

