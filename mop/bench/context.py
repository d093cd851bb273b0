"""`mop bench context`: `mop train` fitting itself to this machine's memory at 128K-1M tokens, and
plain FSDP2 on Hugging Face's model at 16K.

What runs (each a fresh set of the config's local CPU ranks, 2 in the preset, one intra-op thread each):
- mop, per context in `--contexts`: the user's command, `mop train configs/long-context.toml
  --data.seq_len=S` on the anchor-shaped model (`mop.bench.shape.ANCHOR`: hidden 256, 4 blocks, 8
  heads / 2 kv heads of 32, 16 experts of 256 with 2 per token, vocabulary 32000), fp32, with its
  memory settings left automatic: the run fits them to `train.memory_budget` ("auto": the host's
  memory shared by the ranks, `mop.settle.fit`). Every mop technique: Ulysses over both ranks, LLEP,
  the vocabulary ring, the host optimizer, packed documents attended within themselves. Unlike the
  preset's 2 sequences per step, a step here is `--global-batch` (1) sequence, and `--steps` (1)
  steps run: a 1M-token step takes about a quarter of an hour on this machine. The data is the
  shipped corpus's documents repeated (each copy numbered, so no two are alike) until every step
  has its tokens (`--source` to give another), written next to `--out`.
  Reported per context: the settings the run chose, the memory model's prediction (device peak +
  host bytes per rank, the two being one memory on the CPU; config.json's `fit`), the measured
  peak resident memory per rank (`metrics.jsonl`'s `peak_mem_bytes_per_rank`, the process's
  lifetime peak RSS) and that peak less what the process held before the run was built (the
  interpreter, torch, gloo: `mem_before_run_bytes`), which is what the model predicts; and tokens/s.
  A run killed by the kernel (out of memory) is reported as such, and longer contexts are not tried.
- At `--plain-context` (512K), the preset's settings before the fit (activation checkpointing with
  host offload, no head or LLEP chunks, `--train.memory_budget=off`) on the same data: the tokens/s
  the fitted settings must at least match.
- At `--compare-context` (16K), the same work per rank three ways (one S-token sequence per rank
  per step, 2 ranks, same model shape, fp32, `--compare-steps` steps, the first not timed):
  * mop (the preset, fitted);
  * each of `FIXES`: mop with one of issue 50's speed fixes undone (the same run's before and after);
  * `mop train ... --parallel.strategy=fsdp2` with every memory option off: plain FSDP2 on mop's
    model, the packed documents attended within documents by mop's kernel;
  * hf-fsdp2: transformers' `Qwen3MoeForCausalLM` of the same shape (`mop.models.hf.config_to_hf`),
    FSDP2 on every decoder layer and the root, torch AdamW, on the same sequences. It attends
    causally over the whole row (no document mask: transformers' packed-document path needs
    flash attention, which has no CPU kernel), builds the full logits, and has no load-balancing
    loss: strictly less work than the two mop runs. Its peak is the process's peak RSS too.
  Reported: seconds per step and tokens/s per rank, and each one's ratio to hf-fsdp2; for the two
  mop runs, one more step recorded by torch.profiler (`log.profile_step`, `mop.profiling`, not in
  the timing): its seconds in attention, the experts, the vocabulary projection and the rest, each
  with its collectives' part, and what no op covers.

Memory on CPU is resident memory, so it includes what a GPU machine would keep in host memory
(the host optimizer's state); `mop bench e2e` splits device and host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from mop.bench import child
from mop.bench.report import table, write_json
from mop.bench.shape import ANCHOR, add_shape_arguments, shape_overrides
from mop.config import ConfigError, load_config
from mop.flops import phase_flops
from mop.models.config import ModelConfig
from mop.models.families import model_spec
from mop.plan import parse_token_list
from mop.profiling import PHASES
from mop.settle import settle

PRESET = Path(__file__).resolve().parents[2] / "configs" / "long-context.toml"
GB = 1e9
PLAIN_FSDP2 = ["--parallel.strategy=fsdp2", "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
               "--train.activation_checkpointing=none", "--train.offload_activations=false"]
# Issue 50's speed fixes, each undone: name -> the settings that undo it
FIXES = {"mop-logits-recomputed": ["--parallel.vocab_logits=recompute"],
         "mop-freed-memory-unmapped": ["--train.keep_freed_host_memory=false"]}
# The long-context preset's memory settings before runs fitted themselves to their memory
PLAIN_PRESET = ["--train.memory_budget=off", "--train.activation_checkpointing=full",
                "--train.offload_activations=true", "--train.micro_batch=1", "--parallel.vocab_logits=recompute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=PRESET, help="the mop train config (the long-context preset)")
    parser.add_argument("--contexts", default="131072,262144,524288,1048576",
                        help="tokens per sequence, comma-separated, e.g. 128K,1M (empty: the comparisons only)")
    parser.add_argument("--plain-context", type=int, default=524288,
                        help="context of the preset's settings before the fit, against the fitted ones (0: none)")
    parser.add_argument("--compare-context", type=int, default=16384,
                        help="context of the comparison with plain FSDP2 (0: none)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per long-context run")
    parser.add_argument("--global-batch", type=int, default=1, help="sequences per step of the long-context runs")
    parser.add_argument("--compare-steps", type=int, default=3,
                        help="steps of each comparison run at --compare-context; the first is not timed")
    parser.add_argument("--source", default="", help="the training data (default: the shipped corpus repeated)")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/context.json"))
    add_shape_arguments(parser, **ANCHOR)


def long_corpus(path: Path, tokens: int) -> str:
    """A jsonl of the shipped corpus's documents repeated, each copy numbered, with at least `tokens`
    byte tokens (kept when it already has them)."""
    if path.exists() and path.stat().st_size >= tokens:
        return str(path)
    shipped = (resources.files("mop.data") / "corpus" / "corpus.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in shipped]
    path.parent.mkdir(parents=True, exist_ok=True)
    written, copy = 0, 0
    with path.open("w") as out:
        while written < tokens:
            for text in texts:
                line = json.dumps({"text": f"[{copy}] {text}"})
                out.write(line + "\n")
                written += len(line)
            copy += 1
    return str(path)


def mop_train(args, name: str, context: int, extra: list[str], steps: int | None = None,
              profile: bool = False) -> dict:
    """`mop train` in a subprocess; its metrics, or how it failed. `profile`: one more step, recorded
    with torch.profiler (`log.profile_step`) and left out of the timing."""
    steps = steps or args.steps
    if profile:
        extra = [*extra, f"--log.profile_step={steps + 1}"]
        steps += 1
    run_dir = args.out.with_name(f"{args.out.stem}-runs") / f"{name}-{context}"
    command = [sys.executable, "-m", "mop.cli", "train", str(args.config), f"--data.seq_len={context}",
               f"--train.steps={steps}", f"--log.run_dir={run_dir}", "--log.overwrite=true",
               "--log.progress=false", "--log.plot=false", "--log.tensorboard=false", *extra]
    start = time.perf_counter()
    result = {"system": name, "context": context, "command": " ".join(command[2:])}
    try:
        done = child.run(command, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**result, "returncode": None, "error": f"took more than --timeout={args.timeout} s"}
    result.update(wall_s=time.perf_counter() - start, returncode=done.returncode)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("mop: error")]
        result["error"] = errors[-1] if errors else done.stderr[-2000:]
        result["out_of_memory"] = "out-of-memory" in result["error"]
        return result
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resolved = json.loads((run_dir / "config.json").read_text())
    phases = {k: v for k, v in records[-1].items() if k.startswith("time_")} if profile else {}
    if profile:
        phases["mfu"] = phase_mfu(records[-1], resolved)
        records = records[:-1]
    timed = records[1:] or records  # one step: its own time, the first step's costs included
    seconds = statistics.median(r["step_time_s"] for r in timed)
    tokens_per_rank = resolved["train"]["global_batch"] * context / resolved["world"]
    return {**result, "peak_bytes_per_rank": records[-1]["peak_mem_bytes_per_rank"], "seconds_per_step": seconds,
            "before_run_bytes": records[-1].get("mem_before_run_bytes", 0), "fit": resolved.get("fit"),
            "tokens_per_s_per_rank": tokens_per_rank / seconds, "losses": [r["loss"] for r in records],
            "mfu": statistics.median(r["mfu"] for r in timed), "probe_tflops": records[-1]["probe_tflops"],
            "phases": phases, "last_record": records[-1]}


def phase_mfu(record: dict, resolved: dict) -> dict[str, float | None]:
    """Each phase's MFU on a profiled step's `record` of a run settled as `resolved` (its config.json):
    the phase's model FLOPs per rank (`mop.flops.phase_flops`) over its time (worst rank) and the
    run's matmul probe (None: no time in it)."""
    spec = model_spec(ModelConfig(**resolved["model"]))
    positions = resolved["train"]["global_batch"] * resolved["data"]["seq_len"]
    flops, probe = phase_flops(spec, record["model_flops"], positions), record["probe_tflops"] * 1e12
    seconds = {p: record[f"time_{p}_s"] for p in PHASES}
    return {p: flops[p] / resolved["world"] / seconds[p] / probe if seconds[p] else None for p in PHASES}


def hf_rank(rank: int, world: int, config_path: str, overrides: list[str], steps: int) -> dict:
    """One rank of plain FSDP2 on transformers' Qwen3-MoE: its sequence of each step, forward, backward, AdamW."""
    import resource

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mop.data import build_data
    from mop.models.hf import config_to_hf

    config = load_config(config_path, overrides)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_to_hf(config.model, "qwen3_moe")))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    d = config.data
    data = build_data(d.source, d.tokenizer, d.seq_len, config.train.seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        indices = data.stream.next_batch(world)  # one sequence per rank, as mop's plain FSDP2 run takes them
        item = data.dataset[indices[rank]]
        logits = model(input_ids=item["input_ids"].unsqueeze(0)).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), item["labels"],
                                                 ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"times": times, "peak_bytes": peak, "loss": loss.item()}


def hf_fsdp2(args, context: int, common: list[str]) -> dict:
    from mop.testing import run_distributed

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("mop bench context", "the Hugging Face baseline needs transformers; install mop's test "
                          "extras (./mop.sh test does) or skip it with --compare-context=0") from None
    start = time.perf_counter()
    world = settle(load_config(str(args.config), []), fit_memory=False).parallel.nproc  # the ranks mop's runs use
    steps = args.compare_steps
    per_rank = run_distributed(hf_rank, world, str(args.config), [*common, f"--data.seq_len={context}"], steps,
                               timeout=args.timeout)
    seconds = statistics.median(max(r["times"][i] for r in per_rank) for i in range(1, steps))
    return {"system": "hf-fsdp2", "context": context, "wall_s": time.perf_counter() - start, "returncode": 0,
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank], "seconds_per_step": seconds,
            "tokens_per_s_per_rank": context / seconds, "losses": [per_rank[0]["loss"]]}


def run(args) -> dict:
    if args.steps < 1 or args.compare_steps < 2:
        raise ConfigError("--steps" if args.steps < 1 else "--compare-steps",
                          "must be at least 1 (--compare-steps 2: its first step is not timed)")
    contexts = parse_token_list(args.contexts, "--contexts") if args.contexts else []
    needed = max([*contexts, args.plain_context]) * args.global_batch * args.steps
    needed = int(1.1 * max(needed, 2 * args.compare_context * args.compare_steps)) + 1
    source = args.source or long_corpus(args.out.with_name(f"{args.out.stem}-data.jsonl"), needed)
    common = [*shape_overrides(args), f"--data.source={source}"]
    long_runs = [*common, f"--train.global_batch={args.global_batch}"]
    runs = []
    for context in contexts:
        runs.append(mop_train(args, "mop", context, long_runs))
        print(_line(runs[-1]), flush=True)
        if runs[-1]["returncode"] != 0:
            break
    if args.plain_context:
        runs.append(mop_train(args, "mop-plain-preset", args.plain_context, [*long_runs, *PLAIN_PRESET]))
        print(_line(runs[-1]), flush=True)
    comparison = []
    if args.compare_context:
        for name, extra in (("mop", []), *FIXES.items(), ("mop-fsdp2", PLAIN_FSDP2)):
            comparison.append(mop_train(args, name, args.compare_context, [*common, *extra], args.compare_steps,
                                        profile=True))
        comparison.append(hf_fsdp2(args, args.compare_context, common))
        for row in comparison:
            print(_line(row), flush=True)
    return {"runs": runs, "comparison": comparison}


def _line(row: dict) -> str:
    if row["returncode"] != 0:
        return f"  {row['system']} S={row['context']}: failed: {row['error']}"
    peaks = ", ".join(f"{p / GB:.2f}" for p in row["peak_bytes_per_rank"])
    fit = row.get("fit") or {}
    return (f"  {row['system']} S={row['context']}: {row['seconds_per_step']:.1f} s/step, peak GB per rank [{peaks}]"
            f"{'; ' + fit['layout'] if fit else ''}")


def _settings(row: dict) -> str:
    """The memory settings the run ran with: the fit's choice, or the plain preset's."""
    if row.get("fit"):
        return row["fit"]["layout"].replace(" host-optimizer", "")
    return "plain preset: " + " ".join(a.split(".")[-1] for a in PLAIN_PRESET[1:])


def _phase_cell(phases: dict, phase: str) -> str:
    mfu = phases.get("mfu", {}).get(phase)
    return (f"{phases[f'time_{phase}_s']:.1f} ({phases[f'time_{phase}_comm_s']:.1f})"
            + (f" MFU {mfu:.2f}" if mfu is not None else ""))


def report(args, results: dict) -> None:
    rows = []
    for r in results["runs"]:
        if r["returncode"] != 0:
            rows.append([r["system"], r["context"], "OOM" if r.get("out_of_memory") else "failed", "-", "-", "-", "-",
                         "-", "-", "-"])
            continue
        peak, fit = max(r["peak_bytes_per_rank"]), r.get("fit")
        predicted = (fit["predicted_peak_bytes"] + fit["predicted_host_bytes"]) if fit else None
        measured = peak - r["before_run_bytes"]
        rows.append([r["system"], r["context"], _settings(r), predicted / GB if predicted else "-", measured / GB,
                     predicted / measured if predicted else "-", peak / GB, r["tokens_per_s_per_rank"], r["mfu"],
                     r["probe_tflops"]])
    if rows:
        print(table(f"mop train {args.config.name} on the anchor-shaped model, 2 ranks, packed documents, "
                    f"{args.global_batch} sequence(s) per step, memory budget automatic: per rank, the settings the "
                    "run chose, the memory model's prediction (device + host) and the measured peak RSS less the "
                    "process's memory before the run was built, the peak RSS itself, tokens/s, the median MFU "
                    "against the run's matmul probe (mop.flops) and the probe's TFLOP/s per rank",
                    ["system", "context", "settings", "predicted GB", "measured GB", "pred/meas", "peak RSS GB",
                     "tok/s/rank", "MFU", "probe TFLOP/s"], rows))
    if results["comparison"]:
        hf = results["comparison"][-1]
        rows = [[r["system"], r.get("seconds_per_step", "-"), r.get("tokens_per_s_per_rank", "-"),
                 r["tokens_per_s_per_rank"] / hf["tokens_per_s_per_rank"] if r["returncode"] == 0 else "-",
                 max(r["peak_bytes_per_rank"]) / GB if r["returncode"] == 0 else "-", r.get("mfu", "-"),
                 r.get("probe_tflops", "-")] for r in results["comparison"]]
        print()
        print(table(f"same work per rank at {args.compare_context} tokens (one sequence per rank per step; MFU against "
                    "the run's matmul probe, which the hf-fsdp2 anchor does not record)",
                    ["system", "s/step", "tok/s/rank", "vs hf-fsdp2", "peak GB/rank", "MFU", "probe TFLOP/s"], rows))
        rows = [[r["system"], *[_phase_cell(r["phases"], p) for p in PHASES], r["phases"]["time_untracked_s"]]
                for r in results["comparison"] if r.get("phases")]
        print()
        print(table("where a step's time goes (one more step, recorded by torch.profiler, worst rank): seconds per "
                    "phase, of it in collectives in parentheses, and the phase's MFU against the matmul probe (its "
                    "model FLOPs, mop.flops.phase_flops, over its time; profiled, so lower than unprofiled steps); "
                    "untracked: Python between ops and waits for the host optimizer", ["system", *PHASES, "untracked"],
                    rows))
    path = write_json(args.out, "context", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
