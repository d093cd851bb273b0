"""Per-step metrics: one JSON object per line in `metrics.jsonl`, TensorBoard scalars, a PNG at the end.

Only rank 0 writes. Every value logged is already identical on all ranks (reduced by the trainer)
or explicitly per-rank (named so), so one writer loses nothing.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on CUDA; on CPU the process's peak resident set size.

    The CPU number is a process-lifetime high-water mark (it never decreases), which is what the
    operating system can report without instrumenting every allocation.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLogger:
    """metrics.jsonl (one JSON record per step) and TensorBoard scalars in `run_dir`.

    A run resumed at `first_step` keeps the records of the steps before it and drops the later ones
    (they were run after the checkpoint and are run again).
    """

    def __init__(self, run_dir: Path, tensorboard: bool, first_step: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r["step"] < first_step] if first_step and self.path.exists() else []
        self.file = self.path.open("w")
        for record in kept:
            self.file.write(json.dumps(record) + "\n")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(metrics_path: Path, png_path: Path) -> None:
    """Loss and tokens/s against step, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records]
    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    loss_ax.plot(steps, [r["loss"] for r in records])
    loss_ax.set(xlabel="step", ylabel="loss", title="training loss")
    speed_ax.plot(steps, [r["tokens_per_s"] for r in records])
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
