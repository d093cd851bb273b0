"""Per-step metrics: one JSON object per line in `metrics.jsonl`, TensorBoard scalars, Weights & Biases
(optional), a PNG at the end.

Only rank 0 writes. Every value logged is already identical on all ranks (reduced by the trainer)
or explicitly per-rank (named so), so one writer loses nothing.

Techniques report their own metrics through one seam: a module with `drain_metrics()` returns
what it measured since the last call as `{name: (reduction, value)}`, the reduction "max" (the
worst case) or "sum" (a total; a value every rank of a group measures alike is reported by one of
them). `technique_metrics` merges the modules' reports and reduces them over the ranks; the
trainer only logs the result.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import resource
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from mop.config import ConfigError

_REDUCTIONS = {"max": (max, dist.ReduceOp.MAX), "sum": (lambda a, b: a + b, dist.ReduceOp.SUM)}


def drained_metrics(model: torch.nn.Module) -> dict[str, tuple[str, float]]:
    """Every reporting module's metrics since the last call, merged by their reductions (see above)."""
    merged: dict[str, tuple[str, float]] = {}
    for module in model.modules():
        drain = getattr(module, "drain_metrics", None)
        for name, (reduction, value) in (drain() if drain is not None else {}).items():
            if name in merged:
                value = _REDUCTIONS[reduction][0](merged[name][1], value)
            merged[name] = (reduction, float(value))
    return merged


def technique_metrics(model: torch.nn.Module, group: dist.ProcessGroup | None, device: torch.device) -> dict:
    """The step's technique metrics, reduced over the ranks of `group` (None: one process). Every
    rank holds the same reporting modules, so every rank issues the same collectives."""
    merged = drained_metrics(model)
    values = {name: value for name, (_, value) in merged.items()}
    if group is None:
        return values
    for reduction, (_, op) in _REDUCTIONS.items():
        names = sorted(name for name, (r, _) in merged.items() if r == reduction)
        if names:
            reduced = torch.tensor([values[name] for name in names], dtype=torch.float64, device=device)
            dist.all_reduce(reduced, op=op, group=group)  # NCCL reduces device tensors only
            values.update(zip(names, reduced.tolist()))
    return values


def reset_peak_memory(device: torch.device, offload_store=None) -> None:
    """Start a step's peak: the allocator's on CUDA and the activation offload's host bytes."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if offload_store is not None:
        offload_store.reset_peak()


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory: on CUDA the allocator's peak since `reset_peak_memory` (the step's);
    on CPU the process's peak resident set size.

    The CPU number is a process-lifetime high-water mark (it never decreases) of everything the
    process holds, which is what the operating system can report without instrumenting every
    allocation (`mop bench e2e` does instrument them).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def expert_load(counts: torch.Tensor | None, entropy_sums: torch.Tensor | None = None, top_k: int = 1) -> dict:
    """A step's experts' load from its global expert counts `[moe_blocks, E]` (tokens routed to each
    expert, summed over every rank, the MTP depths' blocks after the model's; {} without MoE layers), as
    record values:
    `experts/load_max_over_mean` the most loaded expert's tokens over its layer's mean, worst layer (1:
    even); `experts/load_entropy` the entropy of each layer's experts' shares over log E, mean over the
    layers (1: even, 0: one expert takes every token); `experts/idle` the experts given no token in the
    step, over all layers; with `entropy_sums [moe_layers]` (each layer's summed router entropy over
    its tokens, `RouterStats.entropy`), `experts/router_entropy`: the mean router entropy per token over
    log E, mean over the layers (1: the routers spread each token evenly, 0: they are certain), the
    tokens of a layer being its counts over `top_k`."""
    if counts is None:
        return {}
    router = {}
    if entropy_sums is not None:
        tokens = (counts.double().sum(-1) / top_k).clamp(min=1)
        router = {"experts/router_entropy": float((entropy_sums.double() / tokens).mean() / math.log(counts.shape[-1]))}
    counts = counts.double()
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    entropy = -(shares * shares.clamp(min=1e-300).log()).sum(-1) / math.log(counts.shape[-1])
    worst = (counts.max(-1).values / counts.mean(-1).clamp(min=1e-300)).max()
    return {"experts/load_max_over_mean": float(worst), "experts/load_entropy": float(entropy.mean()),
            "experts/idle": int((counts == 0).sum()), **router}


class DeadExperts:
    """Rank 0's window of the last `window` steps' expert counts (0: none kept): the experts given no
    token in all of them, `experts/dead` once the window is full, and a warning line when experts join
    them (router collapse, an expert the routers stopped choosing)."""

    def __init__(self, window: int, first_layer: int):
        self.window, self.first_layer = window, first_layer
        self.steps: collections.deque = collections.deque(maxlen=window or 1)
        self.dead: set[tuple[int, int]] = set()

    def update(self, counts: torch.Tensor | None) -> tuple[dict, str | None]:
        """The step's record value and the warning to print (None: none)."""
        if counts is None or not self.window:
            return {}, None
        self.steps.append(counts.double())
        if len(self.steps) < self.window:
            return {}, None
        total = torch.stack(list(self.steps)).sum(0)
        dead = {(self.first_layer + layer, expert) for layer, expert in (total == 0).nonzero().tolist()}
        joined, self.dead = dead - self.dead, dead
        warning = None
        if joined:
            named = ", ".join(f"layer {layer} expert {expert}" for layer, expert in sorted(joined)[:8])
            warning = (f"{len(dead)} expert(s) got no token in the last {self.window} steps, {len(joined)} new: {named}"
                       f"{' ...' if len(joined) > 8 else ''} (router collapse? the records' experts/* show the load)")
        return {"experts/dead": len(dead)}, warning


def expert_shares(counts: torch.Tensor | None, first_layer: int) -> dict:
    """Each MoE layer's experts' shares of its routed tokens (`experts/layer_<L>`, L the model's layer
    number), what TensorBoard and W&B show as histograms ({} without MoE layers)."""
    if counts is None:
        return {}
    shares = counts.double() / counts.double().sum(-1, keepdim=True).clamp(min=1)
    return {f"experts/layer_{first_layer + layer}": row.numpy() for layer, row in enumerate(shares)}


class MetricsLogger:
    """metrics.jsonl (one JSON record per step), TensorBoard scalars and, with `wandb`, the same
    scalars in a Weights & Biases run (`WandbRun`) in `run_dir`.

    A record's `step` is the number of steps done after it (1 is the first). A run resumed after
    `first_step` steps keeps the records of those steps and drops the later ones (they were run after
    the checkpoint and are run again); a run directory written before records were numbered so (from
    0, issue 45) has its records renumbered.
    """

    def __init__(self, run_dir: Path, tensorboard: bool, first_step: int = 0, wandb: "WandbRun | None" = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        earlier = read_metrics(self.path) if first_step and self.path.exists() else []
        if any(r["step"] == 0 for r in earlier):  # numbered from 0
            earlier = [{**r, "step": r["step"] + 1} for r in earlier]
        kept = [r for r in earlier if r["step"] <= first_step]
        self.file = self.path.open("w")
        for record in kept:
            self.file.write(json.dumps(record) + "\n")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.wandb = wandb

    def log(self, record: dict, histograms: dict | None = None) -> None:
        """A step's record (metrics.jsonl, scalars) and `histograms` (name -> values; TensorBoard and W&B
        only: too many numbers per step for the records)."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {key: float(value) if isinstance(value, bool) else value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))}  # a flag (skipped, rollback) as 0/1
        histograms = histograms or {}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, record["step"])
            for key, values in histograms.items():
                self.writer.add_histogram(key, values, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, record["step"], histograms)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()


class WandbRun:
    """A Weights & Biases run in `run_dir/wandb` that receives every scalar TensorBoard does.

    A resumed run (the same run directory) continues the same wandb run. Online when wandb has
    credentials (`wandb login` or its own `WANDB_API_KEY`) and reaches its server within `timeout_s`;
    otherwise offline, in the run directory (`wandb sync` uploads it later). `wandb` is an optional extra (`pip install 'mop[wandb]'`); without it `log.wandb = true`
    is a one-line error when the settings are resolved (`check_settings`).
    """

    def __init__(self, run_dir: Path, project: str, name: str, config: dict, timeout_s: int = 30):
        import wandb

        # console "off": wandb would otherwise wrap this process's stdout and stderr (a failing
        # rank's traceback went into its log instead of the terminal)
        # one wandb run per mop run: a resume continues the run its directory started
        id_file = run_dir / "wandb" / "mop-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        options = {"project": project, "name": name or run_dir.name, "dir": str(run_dir), "config": config,
                   "id": run_id, "resume": "allow"}
        quiet = {"console": "off", "silent": True}
        self.run = None
        if wandb.login(prompt=False, verify=False):  # credentials configured: try the server
            try:
                self.run = wandb.init(mode="online", settings=wandb.Settings(init_timeout=timeout_s, **quiet), **options)
            except Exception as e:  # no network, a refused key: the metrics still go to disk
                print(f"mop: wandb could not go online ({type(e).__name__}); logging offline")
        if self.run is None:
            self.run = wandb.init(mode="offline", settings=wandb.Settings(**quiet), **options)
        id_file.write_text(run_id)
        print(f"mop: wandb run {self.run.name!r} ({self.run.settings.mode}) in {self.run.dir}")

    def log(self, scalars: dict, step: int, histograms: dict | None = None) -> None:
        import wandb

        self.run.log({**scalars, **{key: wandb.Histogram(values) for key, values in (histograms or {}).items()}},
                     step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb's service process has written the run's last records
        # (an offline .wandb file read at once held no history); teardown waits for it, where the
        # atexit hook that would otherwise do so does not run in spawned ranks.
        wandb.teardown()


def check_settings(config, world: int) -> None:
    """`log.wandb` needs the optional wandb package."""
    if config.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb", "needs the wandb package; install it with pip install 'mop[wandb]' or set "
                          "--log.wandb=false")


def read_metrics(path: Path) -> list[dict]:
    """The records of metrics.jsonl; a last line cut off by a killed run (no newline yet) is not one."""
    lines = path.read_text().split("\n")[:-1]  # the text after the last newline is incomplete or empty
    return [json.loads(line) for line in lines if line.strip()]


def plot_run(metrics_path: Path, png_path: Path) -> None:
    """The end-of-run figure: loss, tokens/s, per-rank memory, and the expert and optimizer
    metrics when the run has them (LLEP rank imbalance before/after the plan, exposed optimizer time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    present = set().union(*records)  # a resumed run may have changed layout midway
    memory = ["peak_mem_bytes", "mem_param_shards_bytes", "mem_grad_shards_bytes", "mem_optimizer_state_bytes",
              "mem_offloaded_activations_bytes"]
    panels = [("loss", "loss", ["loss", "eval_loss"] if "eval_loss" in present else ["loss"]),
              ("throughput", "tokens/s", ["tokens_per_s"]),
              ("memory, worst rank", "MiB", [key for key in memory if key in present])]
    if "rank_load_imbalance_before" in present:
        panels.append(("expert load, max/mean over ranks", "imbalance",
                       ["rank_load_imbalance_before", "rank_load_imbalance_after"]))
    if "optimizer_exposed_s" in present:
        panels.append(("host optimizer time the step waited for", "seconds", ["optimizer_exposed_s"]))
    if "reward" in present:  # RL: the batch's mean reward, and its mean over the last 10 steps
        panels.append(("reward", "mean reward", ["reward", "reward, last 10 steps"]))
        rewards = [r["reward"] for r in records if "reward" in r]
        for at, r in enumerate(r for r in records if "reward" in r):
            r["reward, last 10 steps"] = sum(rewards[max(0, at - 9):at + 1]) / len(rewards[max(0, at - 9):at + 1])
    if "routing/replay_mismatch" in present:
        panels.append(("routing replay: tokens whose own top-k differs", "share", ["routing/replay_mismatch"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (title, unit, keys) in zip(axes[0], panels):
        for key in keys:
            scale = 2**20 if key.endswith("_bytes") else 1
            having = [r for r in records if key in r]  # evaluations run on some steps only
            ax.plot([r["step"] for r in having], [r[key] / scale for r in having], label=key,
                    marker="o" if len(having) < len(records) else None)
        ax.set(xlabel="step", ylabel=unit, title=title)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
