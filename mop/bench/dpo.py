"""`mop bench dpo`: DPO at long context with the prompt computed once against the prompt repeated.

What runs: two gloo ranks (one intra-op thread each) train the anchor-shaped MoE (hidden 256, 4
blocks, 8 heads / 2 kv heads of 32, 16 experts of width 256 with 2 per token, vocabulary 32000)
with DPO on one preference pair per step: a `--prompt`-token prompt (text of the shipped corpus)
and two `--response`-token responses (other text), byte tokens, the loss on every response token.
In `mop train`'s default layout on 2 ranks (Ulysses D = 2, LLEP over Ep = 2, the vocabulary ring
P = 2, fp32) with full activation checkpointing, twice in the same process tree:
- shared: `data.shared_prompt = true`, one sequence `[P | C] [P[-1] | R]` of p + c + 1 + r tokens,
  the rejected response attending to the prompt as a branch (`mop.models.documents`);
- unshared: `data.shared_prompt = false`, `[P | C] [P | R]` in one sequence of 2p + c + r tokens,
  what trainers that run prompt+chosen and prompt+rejected compute.
Both are full fine-tuning with the reference log-probs precomputed before the timed steps (as
`mop train` does before its first step); `--finetune lora` trains LoRA adapters (rank 16, attention
and routed experts, fp8 base) with the base as reference, a no-grad forward in every step.
Each run is built by `mop.build.build_run` and stepped by the trainer's own `train_step` and
`update` (`mop.testing.step.Trainer`), as `mop train` does; it differs from `mop train` only in
training the same pair every step at the constant `optim.lr`.

Reported per run: the tokens per sequence, the per-rank device memory (`mop.testing.step.step_memory`,
worst rank) and the median step time of `--steps` timed steps; then shared's ratios to unshared.
Times on this machine are noisy: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from importlib import resources
from pathlib import Path

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import ANCHOR, add_shape_arguments, shape_overrides
from mop.testing import run_distributed
from mop.testing.step import timed_steps

WORLD = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, **ANCHOR)
    parser.add_argument("--prompt", type=int, default=32767, help="prompt tokens")
    parser.add_argument("--response", type=int, default=1024, help="tokens of each response (its end-of-text included)")
    parser.add_argument("--finetune", choices=("full", "lora"), default="full")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after a warm-up and a memory step")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/dpo.json"))


def pair_source(args, folder: Path) -> Path:
    """One plain preference row of byte-token lengths prompt, response, response (each response
    followed by the byte tokenizer's end-of-text)."""
    text = "\n".join(json.loads(line)["text"] for line in
                     (resources.files("mop.data") / "corpus" / "corpus.jsonl").read_text().splitlines())
    text = "".join(c for c in text if c.isascii())  # one byte token per character
    need = args.prompt + 2 * args.response
    text = (text * (need // len(text) + 1))[:need]
    prompt, chosen, rejected = (text[:args.prompt], text[args.prompt:args.prompt + args.response - 1],
                                text[args.prompt + args.response:need - 1])
    path = folder / "pair.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def sequence_tokens(args, shared: bool) -> int:
    """The pair's unit, rounded up to the sequence group's multiple."""
    unit = args.prompt + 2 * args.response + 1 if shared else 2 * (args.prompt + args.response)
    return -(-unit // WORLD) * WORLD


def settings(args, source: Path, folder: Path, shared: bool) -> list[str]:
    run = ["--parallel.strategy=mop", f"--parallel.nproc={WORLD}", "--train.dtype=float32", "--train.device=cpu",
           "--data.format=preference", f"--data.source={source}", "--data.tokenizer=byte", "--data.loss_on=all",
           f"--data.seq_len={sequence_tokens(args, shared)}", f"--data.shared_prompt={str(shared).lower()}",
           "--train.global_batch=1", "--train.micro_batch=1", "--train.activation_checkpointing=full",
           "--train.seed=0", f"--train.finetune={args.finetune}", f"--dpo.reference_dir={folder}"]
    lora = ["--lora.rank=16", "--lora.targets=attention,routed_experts", "--lora.base_format=fp8"]
    return [*shape_overrides(args), *run, *(lora if args.finetune == "lora" else [])]


def measure(args, source: Path, work: Path, shared: bool) -> dict:
    overrides = settings(args, source, work / ("shared" if shared else "unshared"), shared)
    ranks = run_distributed(timed_steps, WORLD, overrides, args.steps, timeout=3600)
    worst = max(ranks, key=lambda r: r["device"])
    return {"prompt": "shared" if shared else "repeated", "sequence_tokens": sequence_tokens(args, shared),
            "settings": overrides, "device_bytes": worst["device"], "step_peak_bytes": worst["step_peak"],
            "step_s": max(r["step_s"] for r in ranks)}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="mop-bench-dpo-") as work:
        source = pair_source(args, Path(work))
        shared, unshared = measure(args, source, Path(work), True), measure(args, source, Path(work), False)
    return {"runs": [shared, unshared], "shared_over_unshared": {
        "device_bytes": shared["device_bytes"] / unshared["device_bytes"],
        "step_s": shared["step_s"] / unshared["step_s"]}}


def report(args, results: dict) -> None:
    rows = [[r["prompt"], r["sequence_tokens"], r["device_bytes"] / MIB, r["step_peak_bytes"] / MIB, r["step_s"]]
            for r in results["runs"]]
    ratio = results["shared_over_unshared"]
    rows.append(["shared / repeated", "", ratio["device_bytes"], "", ratio["step_s"]])
    print(table(f"mop bench dpo: one pair per step, a {args.prompt}-token prompt and two {args.response}-token "
                f"responses, {args.finetune} fine-tuning on {WORLD} ranks (per rank, worst rank; fp32, checkpointing; "
                "the reference precomputed before the steps)" if args.finetune == "full" else
                f"mop bench dpo: one pair per step, a {args.prompt}-token prompt and two {args.response}-token "
                f"responses, LoRA on {WORLD} ranks, the base's reference forward in each step (per rank, worst rank; "
                "fp32, checkpointing)",
                ["prompt", "tokens per sequence", "device MiB", "step peak MiB", "step s"], rows))
    print(f"wrote {write_json(args.out, 'dpo', vars(args) | {'out': str(args.out)}, results)}")
