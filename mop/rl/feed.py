"""The RL loop's data: each batch's rollouts sampled by the inference engine with the trainer's
weights, rewarded, and packed as recorded rollouts are (`mop.data.rollouts.packing`), so the loop of
`mop train` (`mop.train`) trains on them unchanged.

`RolloutFeed` stands where a run's `Data` does (`tokenizer`, `dataset`, `stream`). Drawing batch b
(`stream.next_batch`, every rank at the same point of the loop):
1. sync: the run's weights are exported in buckets (`mop.rl.weights.weight_buckets`: collective,
   rank 0 gathers each tensor once; in `rl.sync_dtype`'s form: bf16 for a server, the run's dtype for
   the CPU engine, or as the quantized checkpoint they came from publishes them for a server of it)
   to rank 0's engine (`rl.engine`, `mop.rl.engine`: the CPU engine's folder `<run dir>/engine`, or
   a vLLM or SGLang server through `rl.sync`'s sender, `mop.rl.senders`);
2. sample (rank 0): the engine draws `rl.group` completions of each of the batch's
   `rl.prompts_per_batch` prompts (the prompts' order: a permutation per pass from `train.seed`, as
   the data stream's; the engine's seed from `train.seed` and b), with their sampling log-probs and
   routed experts; the reward function scores each completion's text against the prompt's answer;
3. rank 0 writes the rows to `<run dir>/rollouts/batch_<b>.jsonl` (the record of what was trained:
   `mop train` on the file, `data.format = "rollouts"`, trains on the same data) and says whether it
   succeeded to every rank (one broadcast: a failure is one line on every rank, never a hang);
4. every rank reads the file as recorded rollouts padded to `train.global_batch` sequences
   (`RolloutSettings.sequences`): the advantages from the rewards by group, routes for replay.
With `rl.off_policy` the engine samples batch b + 1 in a thread, with the weights batch b starts
from, while the trainer trains on batch b (sampled the same way one batch earlier): generation
overlaps training, and every batch is one update off-policy (the sampling log-probs' correction,
`rl.correction`, accounts for it); batch 0 is sampled on-policy first. The engine takes the new
weights once that thread is done.

The stream's position counts the sequences of the batches drawn (as a `SequenceStream`'s does), and
it is the state a checkpoint keeps: a resume draws the next batch with the resumed weights (synced
again; with `rl.off_policy`, on-policy), and a resume inside a batch's updates reads its file again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from mop.build import TrainingRun, rollout_settings
from mop.config import Config, ConfigError
from mop.data import DataError, SequenceStream, load_dataset, load_tokenizer, source_options
from mop.data.prepared import ChatSettings
from mop.rl.engine import Engine, SGLangServer, TransformersEngine, VLLMServer
from mop.rl.prompts import Prompts, read_prompts
from mop.rl.rewards import reward_function
from mop.rl.senders import SGLangSender, VLLMFolderSender, VLLMSender
from mop.rl.weights import engine_config, sync_form, weight_buckets


def sampled_data(config: Config, run_dir: Path, is_main: bool, device: torch.device) -> RolloutFeed | None:
    """The RL loop's data where `rl.prompts` names prompts (`mop rl`), else None: the run reads data.source."""
    return RolloutFeed(config, run_dir, is_main, device) if config.rl.prompts else None


def engine_for(config: Config, eos_id: int, folder: Path, device: torch.device) -> Engine:
    """Rank 0's engine (`rl.engine`); a server's sender (`rl.sync`) broadcasts from `device` or writes `folder`
    (`rl.sync_folder` when set)."""
    rl = config.rl
    if rl.engine == "transformers":
        return TransformersEngine(eos_id, folder)
    host, _, port = rl.sync_address.rpartition(":")
    if rl.engine == "vllm":
        if rl.sync == "folder" or (rl.sync == "auto" and device.type != "cuda"):  # vLLM's NCCL group needs CUDA
            sender = VLLMFolderSender(rl.engine_url, Path(rl.sync_folder) if rl.sync_folder else folder)
        else:
            sender = VLLMSender(rl.engine_url, host, int(port), device)
        return VLLMServer(rl.engine_url, sender, rl.engine_model)
    backend = "nccl" if device.type == "cuda" else "gloo"
    return SGLangServer(rl.engine_url, SGLangSender(rl.engine_url, host, int(port), backend, device))


class BatchData:
    """Data served one global batch at a time (the RL loop's, `mop.trainer.Trainer`'s), read where a run reads
    a `mop.data.Data`: `tokenizer`, `dataset` (the batch's), `stream` (itself; `position`: the sequences
    served)."""

    def __init__(self, config: Config):
        d = config.data
        self.config, self.tokenizer = config, load_tokenizer(d.tokenizer, d.eos_token or None)
        self.position, self._dataset = 0, None

    @property
    def stream(self) -> BatchData:
        return self

    @property
    def num_sequences(self) -> int:
        return self.config.train.global_batch


class RolloutFeed(BatchData):
    """The RL loop's data (module docstring); `bind` gives it the run whose weights it samples with."""

    def __init__(self, config: Config, run_dir: Path, is_main: bool, device: torch.device):
        super().__init__(config)
        d, rl = config.data, config.rl
        self.run_dir, self.is_main = run_dir, is_main
        self.chat = ChatSettings(d.tokenizer, d.chat_template, False, "rollouts")
        self.prompts: Prompts = read_prompts(rl.prompts, self.tokenizer, self.chat.template(required=False))
        longest = max(map(len, self.prompts.ids)) + rl.max_completion_length
        if longest > d.seq_len:
            raise ConfigError("data.seq_len", f"{d.seq_len} cannot hold the longest prompt of {rl.prompts} with "
                              f"rl.max_completion_length = {rl.max_completion_length} tokens ({longest}); raise it")
        self.order = SequenceStream(len(self.prompts), config.train.seed, 0, self.prompts.fingerprint)
        self.reward = reward_function(rl.reward)
        self.engine = engine_for(config, self.tokenizer.eos_id, run_dir / "engine", device) if is_main else None
        self.run, self._batch, self._drawn_ahead = None, None, False
        self.sync_dtype, self.published = None, None
        self._pending: Future | None = None
        self._threads = ThreadPoolExecutor(1) if rl.off_policy and is_main else None

    def bind(self, run: TrainingRun) -> None:
        self.run = run

    def _sync_form(self) -> tuple:
        """The weights' form for the engine (`rl.sync_dtype`, `mop.rl.weights.sync_form`), decided at the first
        sync: the run's source is known once it has resumed."""
        if self.sync_dtype is None:
            self.sync_dtype, self.published = sync_form(self.run, self.config.rl.sync_dtype,
                                                        self.config.rl.engine != "transformers")
        return self.sync_dtype, self.published

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()

    # What the loop and checkpoints read of a run's data.

    @property
    def dataset(self):
        """The batch being trained; before the first, the last drawn (a resume's) or batch 0, drawn now
        (the objective reads its rollouts' form when the loop starts)."""
        if self._dataset is None:
            last = self.position // self.num_sequences - 1
            if last >= 0 and self._file(last).is_file():
                self._load(last)
            else:
                self._draw(last + 1)
                self._drawn_ahead = True
        return self._dataset

    def next_batch(self, size: int) -> list[int]:
        """Draw the next batch (module docstring) and serve all its sequences."""
        if not self._drawn_ahead:
            self._draw(self.position // size)
        self._drawn_ahead = False
        self.position += size
        return list(range(size))

    def indices(self, start: int, count: int) -> list[int]:
        """Sequences of the batch at stream position `start` (a resume inside its updates reads its file)."""
        self._load(start // count)
        return list(range(count))

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.config.train.seed, "prompts": self.prompts.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state.get("prompts") != mine["prompts"] or state.get("seed") != mine["seed"]:
            raise DataError("rl.prompts: cannot resume: the checkpoint's RL loop drew from other prompts or another "
                            "train.seed; resume with the same ones, or start from its weights with checkpoint.init")
        self.position, self._dataset, self._drawn_ahead = int(state["position"]), None, False

    # Drawing a batch.

    def _draw(self, batch: int) -> None:
        rl = self.config.rl
        failure, rows, waited = None, None, 0.0
        if self.is_main and self._pending is not None:  # sampled during the last batch, with its weights
            start = time.perf_counter()
            try:
                rows = self._pending.result()
            except Exception as err:  # said on every rank below, then raised here
                failure = err
            self._pending, waited = None, time.perf_counter() - start
        start = time.perf_counter()
        failure = self._sync(failure)
        synced = time.perf_counter()
        if self.is_main and failure is None:
            try:
                rows = rows if rows is not None else self._sample(batch)
                if self._threads is not None:
                    self._pending = self._threads.submit(self._sample, batch + 1)
                write_rows(self._file(batch), rows)
            except Exception as err:
                failure = err
        self._agree(failure, batch)
        self._load(batch)
        if self.is_main:
            sampled = waited if self._threads is not None else time.perf_counter() - synced
            self._dataset.stats.update(_completion_stats(rows, rl.max_completion_length, self.tokenizer.eos_id),
                                       **{"rl/sync_s": synced - start, "rl/generate_s": sampled})

    def _sync(self, failure: Exception | None) -> Exception | None:
        """The run's weights to rank 0's engine (`Engine.take`, in `rl.sync_dtype`'s form); the export is
        collective: every rank iterates it to its end whatever failed."""
        run = self.run
        dtype, published = self._sync_form()
        buckets = weight_buckets(run, self.config.rl.sync_bucket_mb << 20, dtype, published)
        if self.is_main and failure is None:
            try:
                self.engine.take(buckets, engine_config(run, dtype, published))
            except Exception as err:
                failure = err
        for _ in buckets:  # the other ranks' part, or what a failed take left
            pass
        return failure

    def _agree(self, failure: Exception | None, batch: int) -> None:
        """Rank 0's failure to draw, raised on every rank (one broadcast: never a hang)."""
        said = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        if self.run.runtime.layout is not None:
            dist.broadcast_object_list(said, src=0, group=self.run.runtime.layout.world_group)
        if failure is not None:
            raise failure
        if said[0] is not None:
            raise DataError(f"rl.prompts: rank 0 failed to draw batch {batch}'s rollouts ({said[0]})")

    def _sample(self, batch: int) -> list[dict]:
        rl = self.config.rl
        chosen = self.order.indices(batch * rl.prompts_per_batch, rl.prompts_per_batch)
        seed = int.from_bytes(hashlib.blake2b(f"rl/{self.config.train.seed}/{batch}".encode(), digest_size=4).digest())
        rows = self.engine.sample([self.prompts.ids[i] for i in chosen], rl.group, rl.max_completion_length, seed)
        for k, row in enumerate(rows):
            prompt = chosen[k // rl.group]
            text = self.tokenizer.decode([t for t in row["completion_ids"] if t != self.tokenizer.eos_id])
            row.update(reward=float(self.reward(text, self.prompts.answers[prompt])), group=f"{batch}/{prompt}")
        return rows

    def _file(self, batch: int) -> Path:
        return self.run_dir / "rollouts" / f"batch_{batch:06d}.jsonl"

    def _load(self, batch: int) -> None:
        if self._batch == batch and self._dataset is not None:
            return
        config = self.config
        path = self._file(batch)
        if not path.is_file():
            raise DataError(f"rl.prompts: {path}, the rollouts of batch {batch} this run resumes inside, is gone; "
                            "resume from a checkpoint at a batch's start (checkpoint.every a multiple of "
                            "rl.updates_per_batch)")
        self._dataset, self._batch = rollout_batch(config, self.tokenizer, path), batch


def rollout_batch(config: Config, tokenizer, path: Path):
    """The rollout rows of `path` packed as one global batch: recorded rollouts (`RolloutDataset`) padded to
    `train.global_batch` sequences."""
    settings = rollout_settings(config, sequences=config.train.global_batch)
    return load_dataset(str(path), tokenizer, config.data.seq_len, config.train.seed,
                        **source_options(config.data, settings))


def write_rows(path: Path, rows: list[dict]) -> None:
    """The rows as jsonl, whole or not at all (written aside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(".partial")
    aside.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(aside, path)


def _completion_stats(rows: list[dict], limit: int, eos_id: int) -> dict:
    """TRL's completion records: the mean generated length, and the share cut at the length limit."""
    lengths = [len(r["completion_ids"]) for r in rows]
    clipped = [n >= limit and r["completion_ids"][-1] != eos_id for n, r in zip(lengths, rows)]
    return {"completions/mean_length": sum(lengths) / len(rows), "completions/clipped_ratio": sum(clipped) / len(rows)}
