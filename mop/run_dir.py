"""The run directory: where metrics, TensorBoard files, plots and (by default) checkpoints go.

Rank 0 chooses it (`log.run_dir`, or `runs/<UTC time>`) and refuses another run's directory
unless told to overwrite it or to resume; every rank learns rank 0's answer (or its error).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from mop.config import Config, ConfigError
from mop.runtime import Runtime


def resolve_run_dir(config: Config) -> Path:
    """The run directory, refusing to overwrite another run's metrics unless log.overwrite is set
    (or the run resumes from a checkpoint: its metrics continue)."""
    run_dir = Path(config.log.run_dir or Path("runs") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    if (run_dir / "metrics.jsonl").exists() and not (config.log.overwrite or config.checkpoint.resume):
        raise ConfigError("log.run_dir", f"{run_dir} already holds a run; choose another directory, pass "
                          "--log.overwrite=true, or resume it with --checkpoint.resume=latest")
    return run_dir


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
