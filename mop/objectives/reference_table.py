"""A reference's log-probs computed once, before the first step, from the starting weights, in the
run's own layout, and stored beside the run: what an objective whose reference has no base to switch
to reads (DPO's per-response sums, `mop.objectives.preference.reference`; policy-gradient training's
per-token log-probs, `mop.objectives.policy_gradient.reference`). The objective computes the table
(`compute(run)`, every rank the same numpy array); this module stores, finds and checks it.

Where: `<section>.reference_dir` (the objective's settings section; default `<run directory>/reference`)
holds `logps.npy` and `manifest.json`, its identity: the starting weights (the run's seed and
init_std, the Hugging Face import or checkpoint it starts from, or a LoRA run's base), the packed
data's fingerprint, the model's shape and the compute dtype. Rank 0 writes both under a temporary
name and renames them.

Checks (one line each, `ConfigError`): a fresh start reuses a stored table of its own identity and
refuses another's; a resume reads the table its checkpoint recorded (`reference` in its meta; a
checkpoint from before the key was shared has it as `dpo_reference`), refuses a missing or different
one, and refuses data, a model or a dtype other than the table's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch.distributed as dist

from mop.build import TrainingRun
from mop.config import ConfigError

LOGPS, MANIFEST = "logps.npy", "manifest.json"


def folder_of(run: TrainingRun, run_dir: Path, section: str) -> Path:
    return Path(getattr(run.config, section).reference_dir or run_dir / "reference")


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
        if "init" in meta:  # checkpoint.init: another run's weights
            return {"kind": "checkpoint", "path": meta["init"], "step": meta["init_step"]}
        return {"kind": "checkpoint", "config": _digest(meta["config"]["model"]), "step": meta["step"]}
    return {"kind": "initial", "seed": run.config.train.seed, "init_std": run.config.model.init_std}


def identity(run: TrainingRun, meta: dict | None) -> dict:
    config = run.config
    return {"weights": starting_weights(run, meta), "data": run.data.dataset.fingerprint,
            "model": _digest(dataclasses.asdict(config.model)), "dtype": config.train.dtype}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def recorded(meta: dict) -> dict | None:
    """The reference a checkpoint recorded (None: none)."""
    return meta.get("reference", meta.get("dpo_reference"))


def attach(run: TrainingRun, run_dir: Path, meta: dict | None, section: str,
           compute: Callable[[TrainingRun], np.ndarray]) -> dict:
    """Give the run's data (`dataset.reference`) its table of reference log-probs, computed now or
    read (module docstring); returns their identity, which checkpoints record. `meta`: the
    checkpoint the run resumed from (None: a fresh start); `section`: the objective's settings."""
    folder = folder_of(run, run_dir, section)
    resumed = meta is not None and meta["step"] > 0
    if resumed and recorded(meta) is None:
        raise ConfigError(f"{section}.reference", f"the checkpoint at step {meta['step']} records no precomputed "
                          f"reference log-probs; resume it with the {section}.reference it was trained with")
    wanted = recorded(meta) if resumed else identity(run, meta)
    now = identity(run, None)
    changed = [key for key in ("data", "model", "dtype") if wanted[key] != now[key]]
    if changed:
        raise ConfigError(f"{section}.reference", f"the checkpoint's reference log-probs are of {describe(wanted)}; "
                          f"this run has another {', '.join(changed)} ({describe(now)}): resume with the settings "
                          "it was trained with")
    stored = read_manifest(folder, section)
    if stored is not None and stored != wanted:
        raise ConfigError(f"{section}.reference_dir", f"{folder} holds reference log-probs of {describe(stored)}; this "
                          f"run needs those of {describe(wanted)}: move the folder away or set another "
                          f"{section}.reference_dir")
    if stored is None and resumed:
        raise ConfigError(f"{section}.reference_dir", f"{folder} lacks the reference log-probs this run was trained "
                          f"with ({describe(wanted)}); restore them there or set {section}.reference_dir to where "
                          "they are")
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


def read_manifest(folder: Path, section: str) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file() or not (folder / LOGPS).is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{section}.reference_dir", f"{path} is damaged ({err}); move the folder away to "
                          "recompute it")


def write(folder: Path, table: np.ndarray, wanted: dict) -> None:
    """`logps.npy` and `manifest.json` under temporary names, then renamed (the manifest last)."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{LOGPS}.partial.npy"
    np.save(partial, table)
    os.replace(partial, folder / LOGPS)
    partial = folder / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(wanted, indent=1))
    os.replace(partial, folder / MANIFEST)
