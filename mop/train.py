"""The training loop, shared by every strategy.

One optimizer step reads `train.global_batch` sequences (the same ones for every layout, see
`mop.data.loader`). Each data-parallel group takes its contiguous share and runs it in
micro-batches of `train.micro_batch`, accumulating gradients. Each micro-batch contributes its
share of the run's objective (`mop.objectives`: next-token prediction adds
`ce_sum / global_targets + aux_coef * aux_sum / global_batch`), every term divided by a count of
the whole step summed over all ranks before the first forward; the step's gradient is therefore
the gradient of one global objective, whatever the layout or micro-batching.

Then: global gradient-norm clipping, a skipped update when the norm is not finite, AdamW with
the learning-rate schedule (`mop.optim.schedule`), and one metrics record per step (rank 0 writes it).
A step is numbered by the steps done after it, from 1, in its record, the checkpoint it saves
(`step_<N>`), the progress bar and every line, as TRL and transformers log theirs.

What is trained is built by `mop.build.build_run` (strategies: "reference" runs the plain model
in one process; "mop" applies `parallelize`, each technique on its sub-group of ranks; "fsdp2"
applies `parallelize_fsdp2`, the baseline from torch's own pieces). Processes are started by
torchrun or by `mop.launch`; each joins the others in `mop.runtime` and settles the settings for
their world (`mop.settle`, `setup_runtime`). The loop reaches the objective (next-token prediction,
preference pairs) only through its interface (`mop.objectives.base`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import closing, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from mop import checkpoint
from mop.adapters import check_resume
from mop.adapters import summary as adapters_summary
from mop.build import TrainingRun, build_run
from mop.config import Config, ConfigError
from mop.data import count_targets, to_device
from mop.evaluation import evaluate
from mop.faults import PEER_LOST, PeerLost, Stopped, StopRequest, collective_timeout, quiet_exit_code
from mop.flops import Peak, attended_keys, matmul_probe
from mop.metrics import (
    DeadExperts,
    MetricsLogger,
    WandbRun,
    expert_load,
    expert_shares,
    peak_memory_bytes,
    plot_run,
    reset_peak_memory,
    technique_metrics,
)
from mop.models.served_adapters import serving_warnings
from mop.models.transformer import MoETransformer
from mop.objectives import Objective, StepCounts, objective_for
from mop.objectives.base import MicroBatchLoss
from mop.optim.optimizer import Optimizer
from mop.optim.schedule import learning_rate
from mop.parallel.mesh import TorchrunEnv
from mop.profiling import step_profile
from mop.progress import StepProgress
from mop.rl.feed import sampled_data
from mop.run_dir import shared_run_dir
from mop.runtime import (
    Runtime,
    join,
    joined,
    per_rank,
    pick_device,
    smallest_node,
    sum_over_ranks,
    sum_tensor_over_ranks,
    under_torchrun,
)
from mop.settle import MemoryBudget, ResolvedConfig, settle
from mop.settle.fit import summary as fit_summary


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


def worst_rank(values: dict[str, float], runtime: Runtime) -> dict[str, float]:
    """Each value's largest over the ranks (every rank holds the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, sum_over_ranks([values[k] for k in keys], runtime, op=dist.ReduceOp.MAX))) if keys else {}


def worst_rank_state(run: TrainingRun, before_run: int) -> dict:
    """`TrainingRun.state_bytes` of the rank that holds the most of each category, and the most a
    rank held before the run was built (`mem_before_run_bytes`)."""
    state = {**run.state_bytes(), "mem_before_run_bytes": before_run}
    worst = worst_rank({k: v for k, v in state.items() if not isinstance(v, bool)}, run.runtime)
    return {**state, **{k: v if k.startswith("device_bytes_per_param") else int(v) for k, v in worst.items()}}


class StepSums(NamedTuple):
    """This rank's sums of a step's micro-batches, on the device (`forward_backward`)."""

    parts: torch.Tensor
    """float64 `[parts]`: its shares of the step loss's parts."""
    expert_stats: torch.Tensor | None
    """float64 `[moe_layers, E + 1]`: the tokens each expert was routed, then the tokens' summed router
    entropy (`mop.models.transformer.LossTerms.expert_stats`; None without MoE layers)."""


def forward_backward(model: MoETransformer, batches: list[dict], micro_batch_loss: MicroBatchLoss,
                     runtime: Runtime, autocast=nullcontext(), optimizer: Optimizer | None = None) -> StepSums:
    """Forward and backward of this rank's micro-batches, accumulating gradients; returns this
    rank's shares of the step loss's parts and its expert statistics (`micro_batch_loss(batch)`: a
    micro-batch's loss, its float64 parts and its expert statistics, `mop.objectives.base.MicroBatchLoss`),
    summed on the device.

    The optimizer (None: gradients are left on the parameters) is told the phases of the step
    (`mop.optim.optimizer`): the host optimizer's forward waits only for the parameters whose
    update is not finished yet, and every backward hands each gradient over as soon as it is
    reduced; the last one's are final.
    """
    totals = 0  # summed on the device: one host read per step, not per micro-batch
    expert_stats = None
    if optimizer is not None:
        optimizer.before_forward()
    for index, batch in enumerate(batches):
        batch = to_device(batch, runtime.device)
        with autocast:
            loss, parts, stats = micro_batch_loss(batch)
        if optimizer is not None:
            optimizer.before_backward(last=index == len(batches) - 1)
        loss.backward()
        if optimizer is not None:
            optimizer.after_backward()
        totals = totals + parts
        if stats is not None:  # float64: exact counts past 2^24
            expert_stats = stats.double() if expert_stats is None else expert_stats + stats.double()
    return StepSums(totals, expert_stats)


def reduced_sums(sums: StepSums, model: MoETransformer, runtime: Runtime) -> tuple[list[float], torch.Tensor | None]:
    """The step's parts and expert statistics summed over all ranks in one all-reduce and one host read;
    the routers' biases moved by the expert counts (auxiliary-loss-free balancing: after the backward,
    so the next forward routes with them)."""
    flat = sums.parts if sums.expert_stats is None else torch.cat([sums.parts, sums.expert_stats.flatten()])
    flat = sum_tensor_over_ranks(flat, runtime)  # in place: `flat` is the step's own sum (or a fresh concatenation)
    n = len(sums.parts)
    stats = None if sums.expert_stats is None else flat[n:].view_as(sums.expert_stats)
    if stats is not None and model.balances_router_biases:
        model.update_router_biases(stats[:, :-1])
    host = flat.cpu()
    return host[:n].tolist(), None if stats is None else host[n:].view_as(sums.expert_stats)


def train_step(run: TrainingRun, batches: list[dict], update: int = 0, objective: Objective | None = None) -> dict:
    """Forward/backward over this rank's micro-batches of a step (`update`: which of its batch's
    updates, `StepCounts.update`; `objective`: the loop's, None: the run's made now); returns the
    objective's record of the globally reduced losses (`mop.objectives.base`), the step's targets,
    their share of its token positions, its tokens that are data (not padding), its model FLOPs
    (`mop.flops`) and its experts' load and router entropy (`mop.metrics.expert_load`); the step's
    expert counts are kept in `run.expert_counts`."""
    runtime, objective = run.runtime, objective or objective_for(run)
    local_targets = count_targets(batches)
    keys = run.spec.layer_keys(lambda window: sum(int(attended_keys(b["position_ids"], window).sum()) for b in batches))
    tokens = sum(b["input_ids"].numel() for b in batches)
    padding = sum(int(b["padding"].sum()) for b in batches if b.get("padding") is not None)
    counts = sum_over_ranks([local_targets, keys, tokens, padding, *objective.local_counts(batches)], runtime)
    global_targets, keys, tokens, padding = counts[:4]
    step = StepCounts(int(global_targets), run.config.train.global_batch, tuple(counts[4:]), update)
    sums = forward_backward(run.model, batches, objective.micro_batch_loss(step), runtime, run.autocast(),
                            run.optimizer)
    parts, stats = reduced_sums(sums, run.model, runtime)
    run.expert_counts = None if stats is None else stats[:, :-1]
    load = expert_load(run.expert_counts, None if stats is None else stats[:, -1], run.config.model.top_k)
    # Every rank of a sequence group holds distinct tokens, so the sums count each token once.
    model_flops = run.spec.flops_per_token(keys / tokens) * tokens
    return {**objective.record(parts, step), "targets": int(global_targets), "target_share": global_targets / tokens,
            "tokens": int(tokens - padding), "model_flops": model_flops, **load}


def update(run: TrainingRun) -> dict:
    """The step's update after its backward: the global norm, clipping, the optimizer step (or its skip)."""
    return run.optimizer.step(run.config.train.grad_clip)


class NothingToTrain(Exception):
    """A resume whose checkpoint already reached `train.steps` (not an error, no work)."""

    exit_code = 3


def announce(run: TrainingRun, run_dir: Path) -> None:
    """Write the resolved configuration (every default filled in, the layout chosen) to the run
    directory as `config.json`, and say in one line what runs (and in more what was fitted, what the
    data holds that is odd, what a LoRA run trains)."""
    config, runtime, objective = run.config, run.runtime, objective_for(run)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(objective.recorded(config)), indent=1))
    p = config.parallel
    layout = f"D={p.sequence} Ep={p.expert} P={p.vocab}" if p.strategy != "reference" else "one process"
    print(f"mop: {p.strategy} on {runtime.world} rank(s) ({layout}, {runtime.device.type}), {config.train.dtype}, "
          f"{'host' if config.optim.offload else 'torch'} AdamW, {config.train.steps} steps of "
          f"{config.train.global_batch} x {config.data.seq_len} tokens of {objective.describe()}; "
          f"resolved settings in {run_dir / 'config.json'}")
    if config.fit is not None:
        print(f"mop: {fit_summary(config.fit)}")
    for warning in objective.warnings():
        print(f"mop: warning: {warning}", file=sys.stderr)
    if run.mtp is not None:
        print(f"mop: the {run.mtp['layers']} multi-token-prediction layer(s) of {run.mtp['path']} stay frozen, "
              "outside the model trained; mop convert to-hf passes them through")
    if config.adapters is not None:
        print(f"mop: {adapters_summary(run.model, config)}")
        for warning in serving_warnings(config.model, config.adapters):
            print(f"mop: warning: {warning}", file=sys.stderr)


class SkippedSteps:
    """Steps skipped for non-finite gradients: counted in every record, bounded in a row."""

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row, self.last = limit, 0, 0, None

    def count(self, step: int, skipped: bool) -> dict:
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.last = step if skipped else self.last
        return {"skipped_steps": self.total, "skipped_in_a_row": self.in_a_row}

    def check(self, checkpoints: Path) -> None:
        """Stop the run (every rank alike: the norm is global) after `limit` skips in a row."""
        if self.in_a_row >= self.limit:
            kept = checkpoint.complete_checkpoints(checkpoints)
            last_good = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was saved"
            raise ConfigError("train.max_skipped_steps", f"{self.in_a_row} steps in a row had non-finite gradients "
                              f"(the last at step {self.last}); {last_good}; lower optim.lr or raise "
                              "train.max_skipped_steps")


def utilisation(model_flops: float, seconds: float, runtime: Runtime, peak: Peak) -> dict:
    """Model TFLOP/s per rank and MFU against `peak`, with the probe's figure (`mop.flops`)."""
    per_rank = model_flops / seconds / runtime.world
    return {"model_tflops_per_s_per_rank": per_rank / 1e12, **peak.record(per_rank)}


def measured_peak(run: TrainingRun) -> Peak:
    """The run's peak per rank (`mop.flops.Peak`): every rank probes at once (after a reduction that
    lines them up), and the ranks' rates are averaged."""
    runtime = run.runtime
    sum_over_ranks([0.0], runtime)
    probe = sum_over_ranks([matmul_probe(runtime.device, run.config.compute_dtype)], runtime)[0] / runtime.world
    return Peak.of(runtime.device, run.config.compute_dtype, probe)


def setup_runtime(config: Config) -> tuple[ResolvedConfig, Runtime]:
    """Join the ranks (under torchrun, `mop.runtime.join`), settle the settings for that world
    (`mop.settle`: a config settled for it already, as mop's launcher passes its ranks, is used as it
    is) and build the layout; returns the settled config and where this process sits."""
    if not under_torchrun():
        config = config if isinstance(config, ResolvedConfig) and config.world == 1 else settle(config, world=1)
        return config, Runtime(0, 1, pick_device(config, 0), None)
    env = TorchrunEnv.from_environ()
    device = join(config, env)
    if not (isinstance(config, ResolvedConfig) and config.world == env.world_size):
        limits = MemoryBudget.read(config.train).limits(env.local_world_size).smallest_over_ranks(device)
        config = settle(config, world=env.world_size, local_world=smallest_node(env.local_world_size, device),
                        limits=limits)
    return config, joined(config, env, device)


def train(config: Config, say_peer_lost: bool = False) -> list[dict]:
    """Run the configured training in this process (one rank); returns the per-step records.

    SIGTERM / SIGINT stop it after the current step with a checkpoint (`mop.faults.Stopped`). A
    rank that fails only because another one stopped first exits quietly (`quiet_exit_code`), or,
    where it lost the connection to that rank, raises `mop.faults.PeerLost` (mop's launcher names the
    rank; with `say_peer_lost`, under torchrun, a node's first rank says it at once, while a signal
    its agent then sends is still only recorded); a collective that outlives `parallel.timeout_s` is
    one line naming it (`collective_timeout`)."""
    config, runtime = setup_runtime(config)
    run_dir = None
    try:
        with StopRequest() as stop:
            try:
                run_dir = shared_run_dir(config, runtime)
                return _train(config, runtime, stop, run_dir)
            except (Stopped, NothingToTrain):
                raise
            except Exception as err:
                quiet = quiet_exit_code(err, stop) if runtime.layout is not None else None
                if quiet == PEER_LOST and run_dir is not None:
                    newest = checkpoint.complete_checkpoints(checkpoint.checkpoint_dir(config, run_dir))
                    env = TorchrunEnv.from_environ()
                    lost = PeerLost.of(err, env, newest[-1] if newest else None, run_dir)
                    if say_peer_lost and env.local_rank == 0:
                        print(f"mop: error: {lost}", file=sys.stderr, flush=True)
                    raise lost from None
                if quiet is not None:
                    raise SystemExit(quiet) from None
                timeout = collective_timeout(err)
                if timeout is not None:
                    raise timeout from None
                raise
    finally:
        if runtime.layout is not None:
            dist.destroy_process_group()


def _train(config: Config, runtime: Runtime, stop: StopRequest | None = None,
           run_dir: Path | None = None) -> list[dict]:
    """The training loop of `train` (tests call it with a runtime of their own); `stop`: the stop
    request it honours after each step (None: signals are not caught); `run_dir`: the run directory
    every rank agreed on (None: agreed on here)."""
    stop = stop or StopRequest()
    run_dir = run_dir or shared_run_dir(config, runtime)
    # On the CPU what the process holds before the run exists (interpreter, libraries, process
    # groups): the part of `peak_mem_bytes` no memory model of the run accounts for.
    before = peak_memory_bytes(runtime.device)
    feed = sampled_data(config, run_dir, runtime.is_main, runtime.device)  # the RL loop's: rollouts drawn each batch
    with closing(build_run(config, runtime, feed)) as run:  # its worker threads end on every way out
        if feed is not None:
            feed.bind(run)
        return _steps(run, run_dir, stop, before)


def _steps(run: TrainingRun, run_dir: Path, stop: StopRequest, before: int) -> list[dict]:
    """The steps of `_train`'s run: resume, train, evaluate, log, save; the final summary."""
    config, runtime = run.config, run.runtime
    state_memory = worst_rank_state(run, before)
    first_step = resume(run, run_dir)
    if first_step >= config.train.steps:
        raise NothingToTrain(f"the checkpoint resumed is at step {first_step} and train.steps is {config.train.steps}: "
                             f"nothing left to train; raise --train.steps to continue")
    if runtime.is_main:
        announce(run, run_dir)

    logger = None
    if runtime.is_main:
        wandb = (WandbRun(run_dir, config.log.wandb_project, config.log.wandb_name, dataclasses.asdict(config))
                 if config.log.wandb else None)
        logger = MetricsLogger(run_dir, config.log.tensorboard, first_step, wandb)
    progress = StepProgress(run.model.layers, first_step, config.train.steps, run.micro_batches_per_step(),
                            enabled=runtime.is_main and config.log.progress, every=config.log.progress_every)
    skips = SkippedSteps(config.train.max_skipped_steps)
    records: list[dict] = []
    try:
        stopped = _loop(run, run_dir, stop, range(first_step, config.train.steps), records, logger, progress, skips,
                        state_memory)
    finally:  # on an error too: the bar ends and every record written so far is kept
        progress.close()
        if logger is not None:
            logger.close()
    run.optimizer.synchronize()  # the last step's updates, before the model is returned or read
    if logger is not None:
        summarise(run, run_dir, records, skips, state_memory, first_step)
    if stopped is not None:
        raise stopped
    return records


def run_step(run: TrainingRun, step: int, batches: Callable[[], list[dict]], objective: Objective,
             state_memory: dict) -> dict:
    """Optimizer step `step` (from 0) of the run on this rank's micro-batches (`batches()`, read inside the
    step's time: the RL loop draws them then) with the loop's `objective`; returns its record (the losses,
    the update, speed, memory, the data's and the techniques' metrics)."""
    config, runtime = run.config, run.runtime
    if run.peak is None:  # collective: every rank runs its first step together
        run.peak = measured_peak(run)
    reset_peak_memory(runtime.device, run.offload_store)
    start = time.perf_counter()
    lr = learning_rate(config, step)
    run.optimizer.begin_step(lr)
    with step_profile(run.model, step + 1 == config.log.profile_step) as profiled:
        losses = train_step(run, batches(), step % objective.updates_per_batch, objective)
        outcome = update(run)
    elapsed = time.perf_counter() - start
    return {"step": step + 1, **losses, "lr": lr, **outcome,
            "tokens_per_s": losses["tokens"] / elapsed, "step_time_s": elapsed,
            **utilisation(losses["model_flops"], elapsed, runtime, run.peak),
            **step_memory(runtime, run.offload_store), **state_memory, **run.data.dataset.stats,
            **technique_metrics(run.model, runtime.world_group, runtime.device),
            **worst_rank(profiled.record(elapsed), runtime)}


def _loop(run: TrainingRun, run_dir: Path, stop: StopRequest, steps: range, records: list[dict],
          logger: MetricsLogger | None, progress: StepProgress, skips: SkippedSteps, state_memory: dict) -> Stopped | None:
    """Run `steps`, appending each step's record to `records`; a `Stopped` when a signal ended them early."""
    config, runtime = run.config, run.runtime
    objective = objective_for(run)  # one for the whole loop: it may keep a batch's state across its updates
    per_batch, batches = objective.updates_per_batch, None

    def batches_of(step: int) -> list[dict]:
        nonlocal batches
        if step % per_batch == 0:
            batches = run.next_batches()
        elif batches is None:  # resumed inside a batch's updates: the stream served it before the checkpoint
            batches = run.last_batches()
        return batches

    first_moe = config.model.dense_layers
    dead = DeadExperts(config.log.dead_expert_window, first_moe) if runtime.is_main else None
    for step in steps:
        done = step + 1  # every record, checkpoint and line numbers a step by the steps done after it
        record = run_step(run, step, lambda: batches_of(step), objective, state_memory)
        record.update(skips.count(done, record["skipped"]))
        if dead is not None:
            dead_record, warning = dead.update(run.expert_counts)
            record.update(dead_record)
            if warning:
                print(f"mop: warning: {warning}", file=sys.stderr, flush=True)
        if run.held_out is not None and (done % config.eval.every == 0 or done == config.train.steps):
            record["eval_loss"] = evaluate(run)
        records.append(record)
        progress.step_done(done, loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                           **({"eval": f"{record['eval_loss']:.4f}"} if "eval_loss" in record else {}),
                           **({"skipped": record["skipped_steps"]} if record["skipped_steps"] else {}))
        if logger is not None:
            logger.log(record, expert_shares(run.expert_counts, first_moe))
        skips.check(checkpoint.checkpoint_dir(config, run_dir))
        signum = stop.agreed(runtime.world_group, runtime.device)
        if signum is not None and done < config.train.steps:
            return Stopped(signum, done, config.train.steps, save(run, run_dir, done), run_dir)
        # A skipped step changed nothing: no checkpoint rotates out a good one for it.
        every, last = config.checkpoint.every, done == config.train.steps
        if not record["skipped"] and ((every and done % every == 0) or (last and (every or config.checkpoint.final))):
            save(run, run_dir, done)
    return None


def summarise(run: TrainingRun, run_dir: Path, records: list[dict], skips: SkippedSteps, state_memory: dict,
              first_step: int) -> None:
    """Rank 0's end of a run: the plot of its metrics and the summary lines."""
    config = run.config
    if config.log.plot:
        plot_run(run_dir / "metrics.jsonl", run_dir / "loss.png")
    if records and skips.total:
        print(f"mop: {skips.total} step(s) skipped for non-finite gradients")
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:
        print(f"mop: held-out loss {evaluated[-1]['eval_loss']:.4f} after step {evaluated[-1]['step']} "
              f"({config.eval.sequences} sequences)")
    if records:
        per_param = ", ".join(f"{kind} {state_memory[f'device_bytes_per_param_{kind}']:g}"
                              for kind in ("weights", "gradients", "optimizer"))
        print(f"mop: steps {first_step + 1}-{records[-1]['step']}, loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}; {speed_summary(records, run.peak)}; device bytes per parameter: "
              f"{per_param}; run directory {run_dir}")


def speed_summary(records: list[dict], peak: Peak) -> str:
    """The summary's model FLOP rate: the steps' median MFU (the first left out when there are others:
    it warms up) against the peak, and the probe's figure."""
    steps = records[1:] or records
    mfu = statistics.median(r["mfu"] for r in steps)
    probe = f"probe {peak.probe / 1e12:.3g}"
    against = "the matmul probe's" if peak.source == "probe" else f"the device's bf16 peak; {probe}"
    return f"MFU {mfu:.2f} of {peak.flops / 1e12:.3g} TFLOP/s per rank ({against})"


def save(run: TrainingRun, run_dir: Path, done: int) -> Path:
    """Checkpoint `step_<done>` of the run (collective over all ranks)."""
    config = run.config
    return checkpoint.save(checkpoint.checkpoint_dir(config, run_dir), done, run.model, run.optimizer, run.views,
                           run.data.stream.state_dict(), config, config.checkpoint.keep, run.data.tokenizer, run.base,
                           run.reference, run.mtp, run.hf_source)


def resume(run: TrainingRun, run_dir: Path) -> int:
    """Load the checkpoint `checkpoint.resume` names, if any, and prepare what the objective needs
    before its first step (a DPO run's precomputed reference log-probs); returns the first step to run."""
    config = run.config
    path = checkpoint.resolve_resume(config, run_dir)
    meta = None
    if path is None and config.checkpoint.resume and run.runtime.is_main:
        print(f"mop: no complete checkpoint in {checkpoint.checkpoint_dir(config, run_dir)}; starting at step 0")
    if path is not None:
        meta = checkpoint.read_meta(path)
        checkpoint.check_compatible(meta, config, path)
        check_resume(meta, config, run.base, path)
        checkpoint.check_tokenizer(meta, run.data.tokenizer, config, path)
        checkpoint.load(path, run.model, run.optimizer, run.views, meta=meta)
        if meta["data"] is not None:
            run.data.stream.load_state_dict(meta["data"])
    elif config.checkpoint.init:
        meta = start_from(run, Path(config.checkpoint.init))
    take_origin(run, meta)
    run.reference = objective_for(run).prepare(run_dir, meta)
    return meta["step"] if meta is not None else 0


def take_origin(run: TrainingRun, meta: dict | None) -> None:
    """What the run carries of the checkpoint it started from (`meta`; None: none): where the frozen MTP
    layers are (`TrainingRun.mtp`, unless the run trains them as part of its model) and the Hugging Face
    checkpoint its weights came from (`TrainingRun.hf_source`; a LoRA run's is its base, `build_run`)."""
    run.mtp = meta.get("mtp") if meta is not None and not run.config.model.trained_mtp_layers else None
    if run.base is None:
        run.hf_source = meta.get("hf_source") if meta is not None else None


def start_from(run: TrainingRun, path: Path) -> dict:
    """Load the weights of checkpoint `path` (`checkpoint.init`: no optimizer state, no data position);
    returns its meta as a step-0 start's (what a precomputed reference's identity names)."""
    config = run.config
    if not (path / checkpoint.META).is_file():
        raise ConfigError("checkpoint.init", f"{path} is not a complete mop checkpoint (no {checkpoint.META}); pass "
                          "a step_<N> directory (or mop convert from-hf's), or '' to start from the initial weights")
    meta = checkpoint.read_meta(path)
    checkpoint.check_compatible(meta, config, path)
    check_resume(meta, config, run.base, path)
    checkpoint.check_tokenizer(meta, run.data.tokenizer, config, path)
    checkpoint.load(path, run.model, run.optimizer, run.views, with_optimizer=False, meta=meta)
    if run.runtime.is_main:
        print(f"mop: starting from the weights of {path} (step {meta['step']}) at step 0")
    return {**meta, "step": 0, "init": str(path), "init_step": meta["step"]}
