"""The reference log-probs of a DPO run without a base to switch to: computed once, before the first
step, from the starting weights, in the run's own layout, and stored beside the run.

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

Where: `dpo.reference_dir` (default `<run directory>/reference`) holds `logps.npy` and
`manifest.json`, its identity: the starting weights (the run's seed and init_std, the Hugging Face
import or checkpoint it starts from, or a LoRA run's base), the packed data's fingerprint, the
model's shape and the compute dtype. Rank 0 writes both under a temporary name and renames them.

Checks (one line each, `ConfigError`): a fresh start reuses a stored table of its own identity and
refuses another's; a resume reads the table its checkpoint recorded (`dpo_reference` in its meta),
refuses a missing or different one, and refuses data, a model or a dtype other than the table's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mop.build import TrainingRun
from mop.config import ConfigError
from mop.data import to_device
from mop.models.lora import adapters_disabled
from mop.objectives.preference.step import PreferenceLoss

LOGPS, MANIFEST = "logps.npy", "manifest.json"


def folder_of(run: TrainingRun, run_dir: Path) -> Path:
    return Path(run.config.dpo.reference_dir or run_dir / "reference")


def starting_weights(run: TrainingRun, meta: dict | None) -> dict:
    """What the run's weights are before its first step: a LoRA run's base (adapters off), a step-0
    checkpoint it starts from (a Hugging Face import: its directory and fingerprint), or its
    initial values."""
    if run.base is not None:  # the base as the run stores it (its format quantizes it)
        return {**run.base, "base": run.base["kind"], "kind": "lora_base",
                "base_format": run.config.lora.base_format}
    if meta is not None:
        if "hf_weights" in meta:
            return {"kind": "hf", "path": meta["hf_weights"], "fingerprint": meta["hf_fingerprint"]}
        return {"kind": "checkpoint", "config": _digest(meta["config"]["model"]), "step": meta["step"]}
    return {"kind": "initial", "seed": run.config.train.seed, "init_std": run.config.model.init_std}


def identity(run: TrainingRun, meta: dict | None) -> dict:
    config = run.config
    return {"weights": starting_weights(run, meta), "data": run.data.dataset.fingerprint,
            "model": _digest(dataclasses.asdict(config.model)), "dtype": config.train.dtype}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def attach(run: TrainingRun, run_dir: Path, meta: dict | None) -> dict:
    """Give the run's data its reference log-probs (module docstring); returns their identity, which
    checkpoints record. `meta`: the checkpoint the run resumed from (None: a fresh start)."""
    folder = folder_of(run, run_dir)
    resumed = meta is not None and meta["step"] > 0
    if resumed and "dpo_reference" not in meta:
        raise ConfigError("dpo.reference", f"the checkpoint at step {meta['step']} records no precomputed reference "
                          "log-probs; resume it with the dpo.reference it was trained with")
    wanted = meta["dpo_reference"] if resumed else identity(run, meta)
    now = identity(run, None)
    changed = [key for key in ("data", "model", "dtype") if wanted[key] != now[key]]
    if changed:
        raise ConfigError("dpo.reference", f"the checkpoint's reference log-probs are of {describe(wanted)}; this run "
                          f"has another {', '.join(changed)} ({describe(now)}): resume with the settings it was "
                          "trained with")
    stored = read_manifest(folder)
    if stored is not None and stored != wanted:
        raise ConfigError("dpo.reference_dir", f"{folder} holds reference log-probs of {describe(stored)}; this run "
                          f"needs those of {describe(wanted)}: move the folder away or set another dpo.reference_dir")
    if stored is None and resumed:
        raise ConfigError("dpo.reference_dir", f"{folder} lacks the reference log-probs this run was trained with "
                          f"({describe(wanted)}); restore them there or set dpo.reference_dir to where they are")
    if stored is None:
        table = compute(run)
        if run.runtime.is_main:
            write(folder, table, wanted)
        if run.runtime.layout is not None:
            dist.barrier(run.runtime.layout.world_group)
    run.data.dataset.reference = np.load(folder / LOGPS, mmap_mode="r")
    return wanted


def describe(identity: dict) -> str:
    weights = identity["weights"]
    what = {"initial": lambda: f"the initial weights of seed {weights.get('seed')}",
            "hf": lambda: f"the Hugging Face weights {weights.get('path')}",
            "lora_base": lambda: (f"the LoRA base {weights.get('path', 'of the initial weights')} stored as "
                                  f"{weights.get('base_format')}"),
            "checkpoint": lambda: f"a step-{weights.get('step')} checkpoint"}[weights["kind"]]()
    return f"{what} on data {identity['data']} in {identity['dtype']}"


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file() or not (folder / LOGPS).is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError("dpo.reference_dir", f"{path} is damaged ({err}); move the folder away to recompute it")


def write(folder: Path, table: np.ndarray, wanted: dict) -> None:
    """`logps.npy` and `manifest.json` under temporary names, then renamed (the manifest last)."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{LOGPS}.partial.npy"
    np.save(partial, table)
    os.replace(partial, folder / LOGPS)
    partial = folder / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(wanted, indent=1))
    os.replace(partial, folder / MANIFEST)


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
