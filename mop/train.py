"""The training loop, shared by every strategy.

One optimizer step reads `train.global_batch` sequences (the same ones for every layout, see
`mop.data.loader`). Each data-parallel group takes its contiguous share and runs it in
micro-batches of `train.micro_batch`, accumulating gradients. Each micro-batch contributes
`ce_sum / global_targets + aux_coef * aux_sum / global_batch`, where `global_targets` is the
step's count of non-ignored labels summed over all ranks before the first forward; the step's
gradient is therefore the gradient of one global objective, whatever the layout or micro-batching.

Then: global gradient-norm clipping, a skipped update when the norm is not finite, AdamW with
linear warm-up and cosine decay, and one metrics record per step (rank 0 writes it).

Strategies: "reference" runs the plain model in one process; "mop" applies `parallelize` (each
technique on its sub-group of ranks); "fsdp2" applies `parallelize_fsdp2` (the baseline from
torch's own pieces). Distributed runs start under torchrun or from
`launch`, which starts `parallel.nproc` local ranks through torch's elastic launcher.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mop import checkpoint
from mop.config import Config, ConfigError, resolve, validate
from mop.data import DataError, build_data, group_slice, load_batch, micro_batches, sequence_shard
from mop.metrics import MetricsLogger, peak_memory_bytes, plot_run, reset_peak_memory, state_bytes
from mop.models.transformer import IGNORE_INDEX, MoETransformer, build_model
from mop.parallel.mesh import DistLayout, Layout, LayoutError, TorchrunEnv, device_for, init_distributed, set_rank_threads
from mop.optim.host_adamw import HostAdamW
from mop.optim.pipeline import GradientFeed
from mop.progress import StepProgress
from mop.parallel.baseline import parallelize_fsdp2
from mop.parallel.llep import drain_records
from mop.parallel.parallelize import apply_memory_options, compute_dtype, parallelize
from mop.parallel.ulysses import reduce_router_stats

USER_ERRORS = (ConfigError, DataError, LayoutError, NotImplementedError)


@dataclass
class Runtime:
    """Where this process sits: its rank, device and (for distributed runs) its layout."""

    rank: int
    world: int
    device: torch.device
    layout: DistLayout | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True when this process was started by torchrun / torch elastic (it sets these variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def pick_device(config: Config, local_rank: int) -> torch.device:
    if config.train.device == "cpu":
        return torch.device("cpu")
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "'cuda' was asked for but no GPU is visible; use --train.device=cpu or auto")
    return device_for(local_rank)


def setup_runtime(config: Config) -> tuple[Config, Runtime]:
    """Join the ranks (under torchrun) and build the layout; returns the config resolved for this
    world size (`mop.config.resolve`) and where this process sits."""
    if not under_torchrun():
        config = validate(config, world=1)
        return config, Runtime(0, 1, pick_device(config, 0), None)
    env = TorchrunEnv.from_environ()
    config = validate(config, world=env.world_size)
    device = pick_device(config, env.local_rank)
    if device.type == "cpu":
        set_rank_threads(env.local_world_size)
    init_distributed(device)
    p = config.parallel
    layout = DistLayout(Layout(env.world_size, p.sequence, p.expert, p.vocab), device)
    return config, Runtime(env.rank, env.world_size, device, layout)


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


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to `min_ratio` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: torch.nn.Module, config: Config):
    """AdamW with weight decay on matrices only; norms (1-D) are not decayed."""
    o = config.optim
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": o.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def learning_rate(config: Config, step: int) -> float:
    o = config.optim
    return o.lr * lr_factor(step, o.warmup_steps, config.train.steps, o.min_lr_ratio)


def clip_gradients(model: torch.nn.Module, max_norm: float, runtime: Runtime) -> float:
    """The global gradient norm; gradients are scaled by max_norm / norm when it exceeds max_norm.

    Under the `mop` layout every gradient element lives on exactly one rank (dense weights sharded
    over the world, each expert partition over its replica group) except the vocabulary shard,
    replicated on `param.replicas` ranks; the squared norm is the sum over ranks of the local
    squared norms, each divided by its replication. Same formula as torch's `clip_grad_norm_`.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    # A parameter replicated on several ranks (the vocabulary shard) counts once.
    weights = [1.0 / getattr(p, "replicas", 1) for p in params]
    squared = sum(w * n.float().square() for w, n in zip(weights, torch._foreach_norm(local)))
    if runtime.layout is not None:
        # Under FSDP2's CPU offload the gradients are host tensors, and NCCL reduces device tensors only.
        squared = squared.to(runtime.device)
        dist.all_reduce(squared, group=runtime.layout.world_group)
    norm = squared.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(local, scale.to(local[0].device, local[0].dtype))
    return norm.item()


def apply_update(model: torch.nn.Module, optimizer, max_norm: float, runtime: Runtime) -> tuple[float, bool]:
    """Clip, then step unless the global gradient norm is not finite (the update is skipped, state untouched)."""
    grad_norm = clip_gradients(model, max_norm, runtime)
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def host_update(model: torch.nn.Module, host: HostAdamW, feed: GradientFeed, max_norm: float, runtime: Runtime):
    """Validate the host optimizer's speculative updates against the global norm (see HostAdamW).

    `optimizer_exposed_s` is the optimizer time on this step's critical path: `finish` (deciding and
    queueing the updates) plus the time this step's forward waited for the previous step's updates.
    """
    grad_norm = clip_gradients(model, 0.0, runtime)  # the norm only: the host applies the coefficient
    start = time.perf_counter()
    redone = host.finish(grad_norm, max_norm)
    exposed = time.perf_counter() - start + feed.take_wait_s()
    model.zero_grad(set_to_none=True)
    skipped = not math.isfinite(grad_norm)
    return grad_norm, skipped, {"rollback": redone and not skipped, "optimizer_exposed_s": exposed,
                                "gradients_handed_over_in_backward": feed.early}


def expert_metrics(model: torch.nn.Module, runtime: Runtime, expert_ranks: int) -> dict:
    """The step's expert-parallel routing summary over all expert groups (worst case / totals)."""
    if expert_ranks == 1:
        return {}
    records = drain_records(model)
    device = runtime.device  # NCCL reduces device tensors only
    worst = torch.tensor([max((r[k] for r in records), default=0.0) for k in _WORST_KEYS], dtype=torch.float64,
                         device=device)
    total = torch.tensor([sum(r[k] for r in records) for k in _SUM_KEYS], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=runtime.layout.world_group)
    dist.all_reduce(total, group=runtime.layout.world_group)
    # Every rank of an expert group records the same plan: divide the sums by the group size.
    return {**dict(zip(_WORST_KEYS, worst.tolist())), **dict(zip(_SUM_KEYS, (total / expert_ranks).tolist()))}


_WORST_KEYS = ("expert_load_imbalance", "rank_load_imbalance_before", "rank_load_imbalance_after")
_SUM_KEYS = ("tokens_moved", "weight_bytes_moved", "llep_active")  # llep_active: layer passes that spilled


def sum_over_ranks(values: list[float], runtime: Runtime, op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.layout is not None:
        dist.all_reduce(tensor, op=op, group=runtime.layout.world_group)
    return tensor.tolist()


def per_rank(values: list[float], runtime: Runtime) -> list[list[float]]:
    """`values` of every rank, in rank order (one all-gather)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    if runtime.layout is None:
        return [tensor.tolist()]
    gathered = [torch.empty_like(tensor) for _ in range(runtime.world)]
    dist.all_gather(gathered, tensor, group=runtime.layout.world_group)
    return torch.stack(gathered).tolist()


def step_memory(runtime: Runtime, offload_store) -> dict:
    """The step's peak memory per rank and on the worst rank (see `peak_memory_bytes`), and the
    activations the checkpoint offload held in host memory at the step's peak."""
    offloaded = offload_store.peak_bytes if offload_store is not None else 0
    ranks = per_rank([peak_memory_bytes(runtime.device), offloaded], runtime)
    peaks = [int(peak) for peak, _ in ranks]
    record = {"peak_mem_bytes": max(peaks), "peak_mem_bytes_per_rank": peaks}
    if offload_store is not None:
        record["mem_offloaded_activations_bytes"] = int(max(held for _, held in ranks))
    return record


def worst_rank_state(model, optimizer, host, runtime: Runtime) -> dict:
    """`state_bytes` of the rank that holds the most of each category."""
    state = state_bytes(model, optimizer, host)
    keys = [k for k, v in state.items() if not isinstance(v, bool)]
    worst = sum_over_ranks([state[k] for k in keys], runtime, op=dist.ReduceOp.MAX)
    return {**state, **{k: int(v) for k, v in zip(keys, worst)}}


def micro_batches_per_step(config: Config, runtime: Runtime) -> int:
    """Forward passes per optimizer step on each rank: its data group's share of the global batch
    (ranks of a sequence group share sequences) in micro-batches."""
    groups = runtime.world // config.parallel.sequence
    return config.train.global_batch // groups // config.train.micro_batch


def local_batches(data, config: Config, runtime: Runtime) -> list[dict]:
    """This rank's micro-batches of the next step: its data group's sequences, its slice of each.

    Every rank advances the data stream by the same global batch, so the stream's position is
    the checkpointed data position.
    """
    d = config.parallel.sequence
    indices = group_slice(data.stream.next_batch(config.train.global_batch), runtime.rank // d, runtime.world // d)
    batches = [load_batch(data.dataset, part) for part in micro_batches(indices, config.train.micro_batch)]
    return [sequence_shard(batch, runtime.rank % d, d) for batch in batches]


def micro_batch_objective(model: MoETransformer, batch: dict, global_targets: int, global_batch: int,
                          layout: DistLayout | None):
    """Loss terms of one micro-batch and its share of the step objective.

    Under sequence parallelism the D ranks of a group each hold a slice of the same sequences: each
    reduces the router sums over the group and contributes 1/D of the per-sequence aux loss.
    """
    terms = model.loss_terms(batch["input_ids"], batch["labels"], batch["position_ids"], batch["document_ids"])
    copies = layout.layout.sequence if layout is not None else 1
    if copies > 1 and terms.router is not None:
        terms.router = reduce_router_stats(terms.router, layout.sequence_group)
    return terms, model.objective(terms, global_targets, global_batch * copies)


def forward_backward(model: MoETransformer, batches: list[dict], global_targets: int, global_batch: int,
                     runtime: Runtime, autocast=nullcontext(), feed: GradientFeed | None = None) -> tuple[float, float]:
    """Forward and backward of this rank's micro-batches, accumulating gradients; returns this
    rank's (ce, aux) shares of the step loss.

    With a gradient feed (host optimizer), the forward waits only for the parameters whose update
    is not finished yet, and the last micro-batch's backward hands each gradient to the optimizer
    as soon as it is final.
    """
    ce_total, aux_total = 0.0, 0.0
    if feed is not None:
        feed.before_forward()
    for index, batch in enumerate(batches):
        batch = {key: value.to(runtime.device) if value is not None else None for key, value in batch.items()}
        with autocast:
            terms, loss = micro_batch_objective(model, batch, global_targets, global_batch, runtime.layout)
        if feed is not None and index == len(batches) - 1:
            feed.arm()
        loss.backward()
        ce_part = terms.ce_sum.item() / max(global_targets, 1)
        ce_total += ce_part
        aux_total += loss.item() - ce_part
    if feed is not None:
        feed.flush()
    return ce_total, aux_total


def train_step(model: MoETransformer, data, config: Config, runtime: Runtime, autocast,
               feed: GradientFeed | None = None) -> dict:
    """Forward/backward over this rank's share of the step; returns the globally reduced losses."""
    batches = local_batches(data, config, runtime)
    local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    global_targets = int(sum_over_ranks([local_targets], runtime)[0])
    shares = forward_backward(model, batches, global_targets, config.train.global_batch, runtime, autocast, feed)
    ce_loss, aux_loss = sum_over_ranks(list(shares), runtime)
    return {"loss": ce_loss + aux_loss, "ce_loss": ce_loss, "aux_loss": aux_loss, "targets": global_targets}


def train(config: Config) -> list[dict]:
    """Run the configured training in this process (one rank); returns the per-step records."""
    config, runtime = setup_runtime(config)
    try:
        return _train(config, runtime)
    finally:
        if runtime.layout is not None:
            dist.destroy_process_group()


def _train(config: Config, runtime: Runtime) -> list[dict]:
    run_dir = shared_run_dir(config, runtime)
    d = config.data
    data = build_data(d.source, d.tokenizer, d.seq_len, config.train.seed, text_field=d.text_field, bin_dtype=d.bin_dtype)
    if data.tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the tokenizer's "
                          f"{data.tokenizer.vocab_size} ids; set --model.vocab_size={data.tokenizer.vocab_size} or more")
    model = build_model(config.model, config.train.seed, runtime.device)
    if config.parallel.strategy == "mop":
        model = parallelize(model, runtime.layout, config)
    elif config.parallel.strategy == "fsdp2":
        model = parallelize_fsdp2(model, runtime.layout, config)
    else:
        apply_memory_options(model, config, runtime.device)
    optimizer = build_optimizer(model, config)
    host = feed = None
    if config.optim.offload:
        o = config.optim
        host = HostAdamW(optimizer.param_groups, betas=(o.beta1, o.beta2), eps=o.eps)
        feed = GradientFeed(model, host)
    views = checkpoint.GlobalViews(model, runtime.layout)
    state_memory = worst_rank_state(model, optimizer, host, runtime)
    first_step = resume(config, run_dir, model, optimizer, host, views, data)
    dtype = compute_dtype(config)
    autocast = torch.autocast(runtime.device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    logger = MetricsLogger(run_dir, config.log.tensorboard, first_step) if runtime.is_main else None
    records = []
    tokens_per_step = config.train.global_batch * config.data.seq_len
    progress = StepProgress(model.layers, first_step, config.train.steps, micro_batches_per_step(config, runtime),
                            enabled=runtime.is_main and config.log.progress)
    offload_store = getattr(model, "activation_offload", None)
    for step in range(first_step, config.train.steps):
        reset_peak_memory(runtime.device, offload_store)
        start = time.perf_counter()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if host is not None:
            host.begin_step(lr)
        losses = train_step(model, data, config, runtime, autocast, feed)
        if host is None:
            grad_norm, skipped = apply_update(model, optimizer, config.train.grad_clip, runtime)
            rollback = {}
        else:
            grad_norm, skipped, rollback = host_update(model, host, feed, config.train.grad_clip, runtime)

        elapsed = time.perf_counter() - start
        record = {"step": step, **losses, "lr": lr, "grad_norm": grad_norm, "skipped": skipped,
                  "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                  **step_memory(runtime, offload_store), **state_memory, **rollback,
                  **expert_metrics(model, runtime, config.parallel.expert)}
        records.append(record)
        progress.step_done(step, loss=f"{losses['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if logger is not None:
            logger.log(record)
        done = step + 1
        if config.checkpoint.every and (done % config.checkpoint.every == 0 or done == config.train.steps):
            checkpoint.save(checkpoint.checkpoint_dir(config, run_dir), done, model, optimizer, host, views,
                            data.stream.state_dict(), config, config.checkpoint.keep)
    progress.close()
    if host is not None:
        host.synchronize()  # the last step's updates, before the model is returned or read
    if logger is not None:
        logger.close()
        if config.log.plot:
            plot_run(logger.path, run_dir / "loss.png")
        if records:
            print(f"mop: steps {first_step}-{config.train.steps - 1}, loss {records[0]['loss']:.4f} -> "
                  f"{records[-1]['loss']:.4f}; run directory {run_dir}")
    return records


def resume(config: Config, run_dir: Path, model, optimizer, host, views, data) -> int:
    """Load the checkpoint `checkpoint.resume` names, if any; returns the first step to run."""
    path = checkpoint.resolve_resume(config, run_dir)
    if path is None:
        if config.checkpoint.resume and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"mop: no complete checkpoint in {checkpoint.checkpoint_dir(config, run_dir)}; starting at step 0")
        return 0
    meta = checkpoint.read_meta(path)
    checkpoint.check_compatible(meta, config, path)
    checkpoint.load(path, model, optimizer, host, views)
    if meta["data"] is not None:
        data.stream.load_state_dict(meta["data"])
    return meta["step"]


def launch(config: Config) -> list[dict]:
    """Start `parallel.nproc` local ranks with torch's elastic launcher; rank 0's records come back."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=resolve(config).parallel.nproc, run_id=f"mop-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1, start_method="spawn")
    if not config.log.run_dir:
        # Rank 0 writes the run directory; fixing it here keeps it the one the user is told about.
        config = dataclasses.replace(config, log=dataclasses.replace(config.log, run_dir=str(resolve_run_dir(config))))
    results = elastic_launch(launch_config, worker)(config)
    return results[0]


def worker(config: Config) -> list[dict]:
    """Entry point of a launched rank: user errors print one line (rank 0) and exit with code 2."""
    try:
        return train(config)
    except USER_ERRORS as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"mop: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
