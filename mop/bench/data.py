"""`mop bench data`: chat data prepared once with `mop data prepare`, and a run starting on it.

1. Input: a generated conversation file of `--size-mb` (the shipped conversations, repeated, each
   copy's first user turn numbered so that no two rows are alike), jsonl as users keep them.
2. Prepare: `mop data prepare FILE --tokenizer T --out DIR --workers N`, the command users run, in a
   subprocess whose process tree (main process and workers) is sampled every 0.2 s for resident
   memory: tokens/s, source MB/s, the tree's peak and its largest process's.
3. Baseline, in the same run: the file's first `--baseline-mb` encoded in this process and held in
   memory (`encode_source`, what `mop train` does with a raw chat source): tokens/s and the growth of
   resident memory per source MB, against which the prepare's throughput and memory are ratios.
4. Start-up: `load_dataset` on the prepared folder at each of `--seq-lens` (open the memory maps,
   check the manifest, pack every conversation by best-fit decreasing), what `mop train` does
   before its first step: seconds, sequences, padding.
5. Agent traces: 20 conversations of each of `--agent-calls` tool calls (the shipped calculator, a
   reasoned call and its result per step, then the answer) encoded in this process: tokens/s by
   the number of calls, which finding each assistant turn (`mop.data.turns`) must keep flat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from mop.bench import child
from mop.bench.report import table, write_json
from mop.data import load_dataset, load_tokenizer
from mop.data.kinds import encode_source
from mop.data.prepared import ChatSettings
from mop.testing.memory import ResidentGrowth

MB = 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, default=1000, help="the generated conversation file's size")
    parser.add_argument("--tokenizer", default=str(resources.files("mop.data") / "assets" / "qwen3"),
                        help="the tokenizer folder (its chat template); default: the shipped tiny Qwen3 one")
    parser.add_argument("--workers", type=int, default=0, help="prepare's worker processes (0: one per core)")
    parser.add_argument("--baseline-mb", type=float, default=20, help="source MB encoded in one process (baseline)")
    parser.add_argument("--seq-lens", default="4096,32768,131072", help="data.seq_len values to start a run at")
    parser.add_argument("--agent-calls", default="4,16,64", help="tool calls per generated agent trace")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the generated file and prepared folder go "
                        "(default: a folder beside --out, named after it)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/data.json"))


def generate(path: Path, size_bytes: float) -> int:
    """The conversation file (the module docstring); returns its row count."""
    shipped_file = resources.files("mop.data") / "corpus" / "conversations.jsonl"
    shipped = [json.loads(line) for line in shipped_file.read_text().splitlines()]
    written = rows = 0
    with path.open("w") as f:
        while written < size_bytes:
            row = json.loads(json.dumps(shipped[rows % len(shipped)]))
            first_user = next(m for m in row["messages"] if m["role"] == "user")
            first_user["content"] = f"({rows}) {first_user['content']}"
            line = json.dumps(row) + "\n"
            f.write(line)
            written += len(line.encode())
            rows += 1
    return rows


def agent_traces(path: Path, calls: int, rows: int = 20) -> None:
    """`rows` agent traces of `calls` tool calls each (the module docstring, 5)."""
    shipped_file = resources.files("mop.data") / "corpus" / "conversations.jsonl"
    tools = next(json.loads(line)["tools"] for line in shipped_file.read_text().splitlines() if '"tools"' in line)
    with path.open("w") as f:
        for row in range(rows):
            messages = [{"role": "user", "content": f"({row}) Add the numbers 0 to {calls} one step at a time."}]
            for step in range(calls):
                call = {"type": "function", "function": {"name": "calculator", "arguments": {
                    "a": step * (step + 1) // 2, "b": step + 1, "op": "add"}}}
                messages += [{"role": "assistant", "content": "", "reasoning_content": f"Step {step}: add {step + 1}.",
                              "tool_calls": [call]},
                             {"role": "tool", "content": str((step + 1) * (step + 2) // 2)}]
            messages.append({"role": "assistant", "content": f"The sum is {calls * (calls + 1) // 2}."})
            f.write(json.dumps({"messages": messages, "tools": tools}) + "\n")


def encode_agents(work: Path, tokenizer: str, counts: list[int]) -> list[dict]:
    rows = []
    for calls in counts:
        path = work / f"agents-{calls}.jsonl"
        agent_traces(path, calls)
        start = time.perf_counter()
        corpus = encode_source(str(path), ChatSettings(tokenizer))
        seconds = time.perf_counter() - start
        rows.append({"calls": calls, "conversations": len(corpus.offsets) - 1, "tokens": len(corpus.tokens),
                     "tokens_per_s": len(corpus.tokens) / seconds})
    return rows


def _tree_rss(root: int) -> tuple[int, int]:
    """(sum, largest) resident bytes of process `root` and its descendants."""
    sizes = [int(status.get("VmRSS", "0 kB").split()[0]) * 1024 for status in child.process_tree(root).values()]
    return sum(sizes), max(sizes, default=0)


def prepare(source: Path, out: Path, tokenizer: str, workers: int) -> dict:
    """`mop data prepare` as a user runs it, its process tree's memory sampled."""
    command = [sys.executable, "-m", "mop.cli", "data", "prepare", str(source), "--tokenizer", tokenizer,
               "--out", str(out), "--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    peak_sum = peak_one = 0
    with child.session(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        while process.poll() is None:
            total, largest = _tree_rss(process.pid)
            peak_sum, peak_one = max(peak_sum, total), max(peak_one, largest)
            time.sleep(0.2)
        seconds = time.perf_counter() - start
        output = process.stdout.read()
    if process.returncode:
        raise RuntimeError(f"mop data prepare failed ({process.returncode}): {output.strip()}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "tokens": manifest["tokens"], "conversations": manifest["conversations"],
            "tokens_per_s": manifest["tokens"] / seconds, "source_mb_per_s": source.stat().st_size / MB / seconds,
            "peak_tree_rss_bytes": peak_sum, "peak_process_rss_bytes": peak_one, "output": output.strip()}


def baseline(source: Path, slice_path: Path, size_bytes: float, tokenizer: str) -> dict:
    """The first `size_bytes` of the source encoded in this process (the module docstring, 3)."""
    with source.open() as f, slice_path.open("w") as out:
        written = 0
        for line in f:
            if written >= size_bytes:
                break
            out.write(line)
            written += len(line.encode())
    settings = ChatSettings(tokenizer)
    start = time.perf_counter()
    with ResidentGrowth() as growth:
        corpus = encode_source(str(slice_path), settings)
    seconds = time.perf_counter() - start
    tokens = len(corpus.tokens)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "resident_growth_bytes": growth.bytes, "growth_bytes_per_source_mb": growth.bytes / (written / MB)}


def start_up(folder: Path, tokenizer: str, seq_lens: list[int]) -> list[dict]:
    tok, settings = load_tokenizer(tokenizer), ChatSettings(tokenizer)
    rows = []
    for seq_len in seq_lens:
        start = time.perf_counter()
        dataset = load_dataset(str(folder), tok, seq_len, 0, chat=settings, overlong="truncate")
        rows.append({"seq_len": seq_len, "seconds": time.perf_counter() - start, "sequences": len(dataset),
                     **dataset.stats})
    return rows


def run(args) -> dict:
    import os
    import shutil

    work = args.work_dir or args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    source, folder = work / "conversations.jsonl", work / "prepared"
    rows = generate(source, args.size_mb * MB)
    shutil.rmtree(folder, ignore_errors=True)
    workers = args.workers or os.cpu_count() or 1
    prepared = prepare(source, folder, args.tokenizer, workers)
    alone = baseline(source, work / "baseline.jsonl", args.baseline_mb * MB, args.tokenizer)
    starts = start_up(folder, args.tokenizer, [int(s) for s in args.seq_lens.split(",")])
    agents = encode_agents(work, args.tokenizer, [int(c) for c in args.agent_calls.split(",")])
    results = {"rows": rows, "source_bytes": source.stat().st_size, "workers": workers, "prepare": prepared,
               "in_process": alone, "start_up": starts, "agent_traces": agents,
               "throughput_ratio": prepared["tokens_per_s"] / alone["tokens_per_s"],
               "in_process_memory_for_the_whole_source_bytes": alone["growth_bytes_per_source_mb"]
               * source.stat().st_size / MB}
    write_json(args.out, "data", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    return results


def report(args, results: dict) -> None:
    p, a = results["prepare"], results["in_process"]
    size = results["source_bytes"] / MB
    print(table(f"chat data: {size:.0f} MB of jsonl ({results['rows']} conversations, {p['tokens']} tokens), "
                f"tokenizer {args.tokenizer}",
                ["path", "tokens/s", "x in-process", "source MB/s", "peak memory MB", "largest process MB"],
                [[f"mop data prepare, {results['workers']} workers", p["tokens_per_s"], results["throughput_ratio"],
                  p["source_mb_per_s"], p["peak_tree_rss_bytes"] / MB, p["peak_process_rss_bytes"] / MB],
                 [f"in one process ({args.baseline_mb:g} MB)", a["tokens_per_s"], 1.0,
                  "", f"+{a['growth_bytes_per_source_mb'] / MB:.1f} per source MB "
                  f"({results['in_process_memory_for_the_whole_source_bytes'] / MB:.0f} for all)", ""]]))
    print(table("a run starting on the prepared folder (load, check, best-fit packing; before the first step)",
                ["data.seq_len", "seconds", "sequences", "padding share", "overlong dropped", "truncated"],
                [[r["seq_len"], r["seconds"], r["sequences"], r["data_padding_share"], r["data_overlong_dropped"],
                  r["data_overlong_truncated"]] for r in results["start_up"]]))
    print(table("agent traces encoded in one process (a call with reasoning and its result per step)",
                ["tool calls", "conversations", "tokens", "tokens/s"],
                [[r["calls"], r["conversations"], r["tokens"], r["tokens_per_s"]] for r in results["agent_traces"]]))
    print(f"JSON: {args.out}")
