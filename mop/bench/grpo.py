"""`mop bench grpo`: GRPO on long recorded rollouts, routing replay on against off.

What runs: two gloo ranks (one intra-op thread each) train the anchor-shaped MoE (hidden 256, 4
blocks, 8 heads / 2 kv heads of 32, 16 experts of width 256 with 2 per token, vocabulary 32000) on
one `--tokens`-token sequence of recorded rollouts per step: `--rollouts` rollouts of one prompt
group, each a `--prompt`-token prompt (text of the shipped corpus, byte tokens) and a completion
filling the rest, with sampling log-probs (-2 per token), rewards 0, 1, 0, 1, ... and routed experts
in vLLM's HTTP form (base64 of a uint8 `.npy`, `[tokens - 1, layers, top_k]`; ids drawn from a
seeded generator, so replay forces other experts than the router's own). `mop train`'s default layout
on 2 ranks (Ulysses D = 2, LLEP over Ep = 2, the vocabulary ring P = 2, fp32) with full activation
checkpointing, `rl.loss_type = "dapo"`, the sequence_mask correction, twice in the same process tree:
- replay: `rl.replay = "rollout"` (R3): every MoE layer runs the recorded experts;
- free: `rl.replay = "off"`: the routers choose.
Each run is built by `mop.build.build_run` and stepped by the trainer's own `train_step` and
`update` (`mop.testing.step.Trainer`), as `mop train` does; it differs from `mop train` only in
training the same batch every step at the constant `optim.lr`.

Reported per run: the per-rank device memory (`mop.testing.step.step_memory`, worst rank), the
median step time of `--steps` timed steps and the tokens/s it gives; then replay's ratios to free.
Times on this machine are noisy: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import ANCHOR, add_shape_arguments, shape_overrides
from mop.testing import run_distributed
from mop.testing.step import timed_steps

WORLD = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, **ANCHOR)
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of the step's one sequence of rollouts")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts of one prompt in it")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of each rollout")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after a warm-up and a memory step")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/grpo.json"))


def corpus_byte_ids(count: int) -> np.ndarray:
    """`count` byte-token ids of the shipped corpus's ASCII text (repeated where it is shorter)."""
    text = "\n".join(json.loads(line)["text"] for line in
                     (resources.files("mop.data") / "corpus" / "corpus.jsonl").read_text().splitlines())
    ids = np.frombuffer("".join(c for c in text if c.isascii()).encode(), dtype=np.uint8).astype(np.int64)
    return np.resize(ids, count)


def rollout_source(args, folder: Path) -> Path:
    """The rollout rows (module docstring), `--tokens` tokens in all."""
    each = args.tokens // args.rollouts
    ids = corpus_byte_ids(args.tokens)
    generator = np.random.default_rng(0)
    rows = []
    for k in range(args.rollouts):
        tokens = ids[k * each:(k + 1) * each]
        routes = np.stack([generator.permutation(args.experts)[:args.top_k] for _ in range((each - 1) * args.layers)])
        npy = io.BytesIO()
        np.save(npy, routes.reshape(each - 1, args.layers, args.top_k).astype(np.uint8))
        completion = each - args.prompt
        rows.append({"prompt_ids": tokens[:args.prompt].tolist(), "completion_ids": tokens[args.prompt:].tolist(),
                     "sampling_logps": [-2.0] * completion, "reward": float(k % 2), "group": 0,
                     "routed_experts": base64.b64encode(npy.getvalue()).decode()})
    path = folder / "rollouts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def settings(args, source: Path, replay: str) -> list[str]:
    run = ["--parallel.strategy=mop", f"--parallel.nproc={WORLD}", "--train.dtype=float32", "--train.device=cpu",
           "--data.format=rollouts", f"--data.source={source}", "--data.tokenizer=byte",
           f"--data.seq_len={args.tokens}", "--train.global_batch=1", "--train.micro_batch=1",
           "--train.activation_checkpointing=full", "--train.seed=0", "--rl.loss_type=dapo", f"--rl.replay={replay}"]
    return [*shape_overrides(args), *run]


def measure(args, source: Path, replay: str) -> dict:
    overrides = settings(args, source, replay)
    ranks = run_distributed(timed_steps, WORLD, overrides, args.steps, timeout=3600)
    worst = max(ranks, key=lambda r: r["device"])
    step_s = max(r["step_s"] for r in ranks)
    return {"replay": "on (R3)" if replay == "rollout" else "off", "settings": overrides,
            "device_bytes": worst["device"], "step_peak_bytes": worst["step_peak"], "step_s": step_s,
            "tokens_per_s": args.tokens / step_s}


def run(args) -> dict:
    if args.tokens % (WORLD * args.rollouts) or args.tokens // args.rollouts <= args.prompt:
        raise SystemExit(f"mop: error: --tokens {args.tokens} must split into {args.rollouts} rollouts of more than "
                         f"--prompt {args.prompt} tokens, a multiple of {WORLD} in all")
    with tempfile.TemporaryDirectory(prefix="mop-bench-grpo-") as work:
        source = rollout_source(args, Path(work))
        on, off = measure(args, source, "rollout"), measure(args, source, "off")
    return {"runs": [on, off], "replay_over_free": {"device_bytes": on["device_bytes"] / off["device_bytes"],
                                                    "step_s": on["step_s"] / off["step_s"]}}


def report(args, results: dict) -> None:
    rows = [[r["replay"], r["device_bytes"] / MIB, r["step_peak_bytes"] / MIB, r["step_s"], r["tokens_per_s"]]
            for r in results["runs"]]
    ratio = results["replay_over_free"]
    rows.append(["on / off", ratio["device_bytes"], "", ratio["step_s"], ""])
    print(table(f"mop bench grpo: {args.rollouts} rollouts ({args.prompt}-token prompts) in one {args.tokens}-token "
                f"sequence per step, dapo with the sequence_mask correction, full fine-tuning on {WORLD} ranks "
                "(per rank, worst rank; fp32, checkpointing)",
                ["routing replay", "device MiB", "step peak MiB", "step s", "tokens/s"], rows))
    print(f"wrote {write_json(args.out, 'grpo', vars(args) | {'out': str(args.out)}, results)}")
