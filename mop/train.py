"""The training loop, shared by every strategy.

One optimizer step reads `train.global_batch` sequences (the same ones for every layout, see
`mop.data.loader`). Each data-parallel group takes its contiguous share and runs it in
micro-batches of `train.micro_batch`, accumulating gradients. Each micro-batch contributes
`ce_sum / global_targets + aux_coef * aux_sum / global_batch`, where `global_targets` is the
step's count of non-ignored labels summed over all ranks before the first forward; the step's
gradient is therefore the gradient of one global objective, whatever the layout or micro-batching.

Then: global gradient-norm clipping, a skipped update when the norm is not finite, AdamW with
the learning-rate schedule (`mop.optim.schedule`), and one metrics record per step (rank 0 writes it).
A step is numbered by the steps done after it, from 1, in its record, the checkpoint it saves
(`step_<N>`), the progress bar and every line, as TRL and transformers log theirs.

What is trained is built by `mop.build.build_run` (strategies: "reference" runs the plain model
in one process; "mop" applies `parallelize`, each technique on its sub-group of ranks; "fsdp2"
applies `parallelize_fsdp2`, the baseline from torch's own pieces). Processes are started by
torchrun or by `mop.launch`; each joins the others in `mop.runtime` and resolves the settings for
their world (`setup_runtime`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import closing, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from mop import checkpoint
from mop.adapters import check_resume
from mop.adapters import summary as adapters_summary
from mop.build import TrainingRun, build_run
from mop.config import Config, ConfigError
from mop.data import Data, count_targets, to_device
from mop.evaluation import evaluate
from mop.faults import PEER_LOST, PeerLost, Stopped, StopRequest, collective_timeout, quiet_exit_code
from mop.flops import attended_keys, peak_flops
from mop.metrics import (
    MetricsLogger,
    WandbRun,
    peak_memory_bytes,
    plot_run,
    reset_peak_memory,
    technique_metrics,
)
from mop.models.transformer import MoETransformer
from mop.optim.optimizer import Optimizer
from mop.optim.schedule import learning_rate
from mop.parallel.mesh import TorchrunEnv
from mop.plan.fit import fitted
from mop.plan.fit import summary as fit_summary
from mop.preference import reference
from mop.preference.loss import StepTotals
from mop.preference.step import PreferenceObjective, local_counts, step_record
from mop.profiling import step_profile
from mop.progress import StepProgress
from mop.resolve import ResolvedConfig
from mop.run_dir import shared_run_dir
from mop.runtime import (
    Runtime,
    host_memory_bytes,
    join,
    joined,
    memory_budget,
    per_rank,
    pick_device,
    smallest_limits,
    smallest_node,
    sum_over_ranks,
    sum_tensor_over_ranks,
    under_torchrun,
)


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


class SupervisedObjective:
    """`forward_backward`'s objective for next-token prediction: (loss, its float64 parts (ce, aux),
    expert counts) of one micro-batch (`MoETransformer.objective`)."""

    PARTS = ("ce_loss", "aux_loss")

    def __init__(self, model: MoETransformer, global_targets: int, global_batch: int):
        self.model, self.global_targets, self.global_batch = model, global_targets, global_batch

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        terms = self.model.loss_terms(batch["input_ids"], batch["labels"], batch["position_ids"],
                                      batch["document_ids"], batch.get("padding"))
        loss = self.model.objective(terms, self.global_targets, self.global_batch)
        ce = terms.ce_sum.detach().double() / max(self.global_targets, 1)
        return loss, torch.stack([ce, loss.detach().double() - ce]), terms.expert_counts


def forward_backward(model: MoETransformer, batches: list[dict], objective, runtime: Runtime,
                     autocast=nullcontext(), optimizer: Optimizer | None = None) -> list[float]:
    """Forward and backward of this rank's micro-batches, accumulating gradients; returns this
    rank's shares of the step loss's parts (`objective(batch)` gives a micro-batch's loss, its
    float64 parts and its expert counts: `SupervisedObjective`, `mop.preference.step`).

    The optimizer (None: gradients are left on the parameters) is told the phases of the step
    (`mop.optim.optimizer`): the host optimizer's forward waits only for the parameters whose
    update is not finished yet, and every backward hands each gradient over as soon as it is
    reduced; the last one's are final.
    """
    totals = 0  # summed on the device: one host read per step, not per micro-batch
    expert_counts = 0
    if optimizer is not None:
        optimizer.before_forward()
    for index, batch in enumerate(batches):
        batch = to_device(batch, runtime.device)
        with autocast:
            loss, parts, counts = objective(batch)
        if optimizer is not None:
            optimizer.before_backward(last=index == len(batches) - 1)
        loss.backward()
        if optimizer is not None:
            optimizer.after_backward()
        totals = totals + parts
        if counts is not None:
            expert_counts = expert_counts + counts.double()  # exact counts past 2^24
    if model.balances_router_biases:  # after the backward: the next forward routes with the moved biases
        model.update_router_biases(sum_tensor_over_ranks(expert_counts, runtime))
    return totals.tolist()


def train_step(run: TrainingRun, batches: list[dict]) -> dict:
    """Forward/backward over this rank's micro-batches of a step; returns the globally reduced
    losses (and, for preference pairs, TRL's records: `mop.preference`), the step's targets, their
    share of its token positions, its tokens that are data (not padding) and its model FLOPs
    (`mop.flops`)."""
    runtime, config = run.runtime, run.config
    preference = config.data.format == "preference"
    local_targets = count_targets(batches)
    keys = run.spec.layer_keys(lambda window: sum(int(attended_keys(b["position_ids"], window).sum()) for b in batches))
    tokens = sum(b["input_ids"].numel() for b in batches)
    padding = sum(int(b["padding"].sum()) for b in batches if b.get("padding") is not None)
    counts = sum_over_ranks([local_targets, keys, tokens, padding, *(local_counts(batches) if preference else [])],
                            runtime)
    global_targets, keys, tokens, padding = counts[:4]
    if preference:
        totals = StepTotals(int(counts[4]), int(counts[5]), config.train.global_batch)
        objective = PreferenceObjective(run.model, config.dpo, totals, run.data.dataset.pairs_max)
    else:
        objective = SupervisedObjective(run.model, int(global_targets), config.train.global_batch)
    parts = sum_over_ranks(forward_backward(run.model, batches, objective, runtime, run.autocast(), run.optimizer),
                           runtime)
    if preference:
        losses = step_record(parts, config.dpo.nll_alpha, totals)
    else:
        losses = {"loss": sum(parts), **dict(zip(SupervisedObjective.PARTS, parts))}
    # Every rank of a sequence group holds distinct tokens, so the sums count each token once.
    model_flops = run.spec.flops_per_token(keys / tokens) * tokens
    return {**losses, "targets": int(global_targets), "target_share": global_targets / tokens,
            "tokens": int(tokens - padding), "model_flops": model_flops}


def update(run: TrainingRun) -> dict:
    """The step's update after its backward: the global norm, clipping, the optimizer step (or its skip)."""
    return run.optimizer.step(run.config.train.grad_clip)


class NothingToTrain(Exception):
    """A resume whose checkpoint already reached `train.steps` (not an error, no work)."""

    exit_code = 3


def announce(config: Config, runtime: Runtime, run_dir: Path, data: Data, model: MoETransformer) -> None:
    """Write the resolved configuration (every default filled in, the layout chosen) to the run
    directory as `config.json`, and say in one line what runs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
    p = config.parallel
    layout = f"D={p.sequence} Ep={p.expert} P={p.vocab}" if p.strategy != "reference" else "one process"
    print(f"mop: {p.strategy} on {runtime.world} rank(s) ({layout}, {runtime.device.type}), {config.train.dtype}, "
          f"{'host' if config.optim.offload else 'torch'} AdamW, {config.train.steps} steps of "
          f"{config.train.global_batch} x {config.data.seq_len} tokens of {describe_data(config, data)}; "
          f"resolved settings in {run_dir / 'config.json'}")
    if config.fit is not None:
        print(f"mop: {fit_summary(config.fit)}")
    degenerate = data.dataset.stats.get("data_degenerate_pairs", 0)
    if degenerate:
        where = ", ".join(data.dataset.corpus.degenerate_examples[:3])
        print(f"mop: warning: {degenerate} preference pair(s) have the same chosen and rejected tokens"
              f"{f' (e.g. {where})' if where else ''}: each adds a constant to the loss, no gradient and a miss to "
              "rewards/accuracies; set data.skip_invalid = true to drop them", file=sys.stderr)
    if config.adapters is not None:
        print(f"mop: {adapters_summary(model, config)}")


def describe_data(config: Config, data: Data) -> str:
    """The start line's account of the data: its format, sequences and, for chat, what was left out."""
    d, stats = config.data, data.dataset.stats
    if d.format == "text":
        return f"text ({data.stream.num_sequences} sequences)"
    if d.format == "preference":
        dpo = config.dpo
        return (f"preference pairs, {dpo.loss} beta {dpo.beta}, reference {dpo.reference}, prompt "
                f"{'shared' if d.shared_prompt else 'repeated'}, loss on {d.loss_on} ({stats['data_pairs']} pairs in "
                f"{data.stream.num_sequences} sequences, {stats['data_padding_share']:.1%} padding; overlong: "
                f"{stats['data_overlong_dropped']} dropped, {stats['data_overlong_truncated']} truncated; "
                f"{stats['data_skipped_invalid']} invalid skipped; {stats['data_degenerate_pairs']} degenerate)")
    return (f"chat, loss on {d.loss_on} ({stats['data_conversations']} conversations in {data.stream.num_sequences} "
            f"sequences, {stats['data_padding_share']:.1%} padding; overlong: {stats['data_overlong_dropped']} dropped, "
            f"{stats['data_overlong_truncated']} truncated; {stats['data_skipped_invalid']} invalid skipped)")


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


def utilisation(model_flops: float, seconds: float, runtime: Runtime) -> dict:
    """Model TFLOP/s per rank and, on a GPU of known peak, MFU (`mop.flops`)."""
    per_rank = model_flops / seconds / runtime.world
    peak = peak_flops(runtime.device)
    return {"model_tflops_per_s_per_rank": per_rank / 1e12, **({"mfu": per_rank / peak} if peak else {})}


def setup_runtime(config: Config) -> tuple[ResolvedConfig, Runtime]:
    """Join the ranks (under torchrun, `mop.runtime.join`), resolve the settings for that world
    (`mop.resolve`: a config resolved for it already, as mop's launcher passes its ranks, is used as
    it is) and build the layout; returns the resolved config and where this process sits."""
    if not under_torchrun():
        config = config if isinstance(config, ResolvedConfig) and config.world == 1 else fitted(config, world=1)
        return config, Runtime(0, 1, pick_device(config, 0), None)
    env = TorchrunEnv.from_environ()
    device = join(config, env)
    if not (isinstance(config, ResolvedConfig) and config.world == env.world_size):
        budget = memory_budget(config.train.memory_budget, config.train.device, env.local_world_size)
        budget_bytes, host_bytes = smallest_limits(budget and budget[0], host_memory_bytes(), device)
        config = fitted(config, world=env.world_size, local_world=smallest_node(env.local_world_size, device),
                        budget_bytes=budget_bytes, host_bytes=host_bytes)
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
    with closing(build_run(config, runtime)) as run:  # its worker threads end on every way out
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
        announce(config, runtime, run_dir, run.data, run.model)

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


def _loop(run: TrainingRun, run_dir: Path, stop: StopRequest, steps: range, records: list[dict],
          logger: MetricsLogger | None, progress: StepProgress, skips: SkippedSteps, state_memory: dict) -> Stopped | None:
    """Run `steps`, appending each step's record to `records`; a `Stopped` when a signal ended them early."""
    config, runtime = run.config, run.runtime
    for step in steps:
        done = step + 1  # every record, checkpoint and line numbers a step by the steps done after it
        reset_peak_memory(runtime.device, run.offload_store)
        start = time.perf_counter()
        lr = learning_rate(config, step)
        run.optimizer.begin_step(lr)
        with step_profile(run.model, done == config.log.profile_step) as profiled:
            losses = train_step(run, run.next_batches())
            outcome = update(run)
        elapsed = time.perf_counter() - start
        record = {"step": done, **losses, "lr": lr, **outcome,
                  "tokens_per_s": losses["tokens"] / elapsed, "step_time_s": elapsed,
                  **utilisation(losses["model_flops"], elapsed, runtime),
                  **step_memory(runtime, run.offload_store), **state_memory, **run.data.dataset.stats,
                  **technique_metrics(run.model, runtime.world_group, runtime.device),
                  **worst_rank(profiled.record(elapsed), runtime)}
        record.update(skips.count(done, outcome["skipped"]))
        if run.held_out is not None and (done % config.eval.every == 0 or done == config.train.steps):
            record["eval_loss"] = evaluate(run)
        records.append(record)
        progress.step_done(done, loss=f"{losses['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                           **({"eval": f"{record['eval_loss']:.4f}"} if "eval_loss" in record else {}),
                           **({"skipped": record["skipped_steps"]} if record["skipped_steps"] else {}))
        if logger is not None:
            logger.log(record)
        skips.check(checkpoint.checkpoint_dir(config, run_dir))
        signum = stop.agreed(runtime.world_group, runtime.device)
        if signum is not None and done < config.train.steps:
            return Stopped(signum, done, config.train.steps, save(run, run_dir, done), run_dir)
        # A skipped step changed nothing: no checkpoint rotates out a good one for it.
        every, last = config.checkpoint.every, done == config.train.steps
        if not outcome["skipped"] and ((every and done % every == 0) or (last and (every or config.checkpoint.final))):
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
              f"{records[-1]['loss']:.4f}; device bytes per parameter: {per_param}; run directory {run_dir}")


def save(run: TrainingRun, run_dir: Path, done: int) -> Path:
    """Checkpoint `step_<done>` of the run (collective over all ranks)."""
    config = run.config
    return checkpoint.save(checkpoint.checkpoint_dir(config, run_dir), done, run.model, run.optimizer, run.views,
                           run.data.stream.state_dict(), config, config.checkpoint.keep, run.data.tokenizer, run.base,
                           run.reference)


def resume(run: TrainingRun, run_dir: Path) -> int:
    """Load the checkpoint `checkpoint.resume` names, if any, and a DPO run's precomputed reference
    log-probs (`mop.preference.reference`); returns the first step to run."""
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
    if config.data.format == "preference" and config.dpo.reference == "precomputed":
        run.reference = reference.attach(run, run_dir, meta)
    return meta["step"] if meta is not None else 0
