"""The run directory: where metrics, TensorBoard files, plots and (by default) checkpoints go.

Rank 0 chooses it (`log.run_dir`, or `runs/<UTC time>`) and never mixes two runs in it (see
`resolve_run_dir`), nor writes into a Hugging Face model's directory; every rank learns rank 0's
answer (or its error).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from mop import checkpoint
from mop.config import Config, ConfigError
from mop.runtime import Runtime


def resolve_run_dir(config: Config) -> Path:
    """The run directory, which never mixes two runs.

    A directory holding another run (metrics or complete checkpoints) is refused, unless
    `log.overwrite` is set, when that run's files (and its checkpoints, wherever `checkpoint.dir`
    puts them) are moved aside, never deleted; or unless the run resumes: resuming this
    directory's own checkpoint continues its metrics, and a resume that finds no checkpoint of this
    directory (or resumes another directory's) moves this directory's earlier files aside first.
    """
    run_dir = Path(config.log.run_dir or Path("runs") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    if holds_a_model(run_dir):  # the run's config.json would overwrite the model's
        raise ConfigError("log.run_dir", f"{run_dir} holds a Hugging Face model (config.json, safetensors); the run "
                          "would overwrite its config.json: choose another directory")
    checkpoints = checkpoint.checkpoint_dir(config, run_dir)
    has_metrics = (run_dir / "metrics.jsonl").exists()
    held = has_metrics or bool(checkpoint.complete_checkpoints(checkpoints))
    if not held:
        return writable(run_dir, checkpoints)
    resume = config.checkpoint.resume
    if not (config.log.overwrite or resume):
        # The setting whose directory holds the run: checkpoint.dir when only its checkpoints are there.
        key, holder = ("log.run_dir", run_dir) if has_metrics or not config.checkpoint.dir else ("checkpoint.dir", checkpoints)
        raise ConfigError(key, f"{holder} already holds a run; choose another directory, pass "
                          "--log.overwrite=true (the old run is moved aside), or resume it with "
                          "--checkpoint.resume=latest")
    resumed = checkpoint.resolve_resume(config, run_dir) if resume else None
    if resumed is None or resumed.parent.resolve() != checkpoints.resolve():
        aside = _move_aside(run_dir, checkpoints)
        print(f"mop: the earlier run in {run_dir} was moved to {aside}")
    return writable(run_dir, checkpoints)


def holds_a_model(directory: Path) -> bool:
    """Whether `directory` is a Hugging Face model's (a LoRA run's base, an export): safetensors files
    beside a config.json."""
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def writable(run_dir: Path, checkpoints: Path) -> Path:
    """`run_dir`, once it and the checkpoint directory are known to be writable: checked before
    training starts, not at the first save hours later."""
    for directory, setting in ((run_dir, "log.run_dir"), (checkpoints, "checkpoint.dir")):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".mop-write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(setting, f"{directory} cannot be written ({err.strerror or err}); "
                              "choose a directory this user can create and write") from None
    return run_dir


def _move_aside(run_dir: Path, checkpoints: Path) -> Path:
    """Rename the run directory (and a checkpoint directory outside it) to `<name>.replaced-<UTC time>`."""
    suffix = ".replaced-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    if checkpoints.exists() and not checkpoints.resolve().is_relative_to(run_dir.resolve()):
        checkpoints.rename(checkpoints.with_name(checkpoints.name + suffix))
    aside = run_dir.with_name(run_dir.name + suffix)
    if run_dir.exists():
        run_dir.rename(aside)
    return aside


def shared_run_dir(config: Config, runtime: Runtime) -> Path:
    """Rank 0's run directory, on every rank (checkpoints go under it); its error, on every rank."""
    if runtime.layout is None:
        return resolve_run_dir(config)
    answer = [None]
    if runtime.is_main:
        try:
            answer[0] = str(resolve_run_dir(config))
        except ConfigError as err:
            answer[0] = (err.key, str(err).removeprefix(f"{err.key}: "))
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], tuple):
        raise ConfigError(*answer[0])
    return Path(answer[0])
