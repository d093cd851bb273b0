"""`mop bench grpo-trl`: the GRPO step on long rollouts, mop's against TRL's, on the same model, rows and cores.

The work, the same on both sides. The anchor-shaped MoE (hidden 256, 4 blocks, 8 heads / 2 kv heads
of 32, 16 experts of width 256 with 2 per token, vocabulary 32000) as transformers'
`Qwen3MoeForCausalLM` (`mop.models.hf.config_to_hf`, seeded initialisation), saved, and imported
into mop (`mop convert from-hf`'s `import_hf`): the same weights at step 1. Per length L: one group
of `--rollouts` rollouts of one `--prompt`-token prompt (text of the shipped corpus, byte tokens),
each completion filling the rest of L; rewards 0, 1, 2, ... (their group advantages); sampling
log-probs the model's own (a no-grad transformers pass before either side runs, not timed) moved by
a per-rollout shift of -0.4 ... +0.4 nats over the completion, so the sequence_mask correction
weighs rollouts differently (and a step's loss is not the 0 of equal weights). One update per batch,
DAPO (both defaults), the k3 KL to the reference with `--beta`, the sequence_mask correction in
[0, 3] (both defaults), fp32, the router's load-balancing loss off (transformers' default), AdamW.

- trl: TRL 1.16's own code on one process using both cores (TRL's accelerate path runs on CPU as one
  process; FSDP over gloo is not among its supported setups): the model with gradient checkpointing
  (non-reentrant, TRL's default) and TRL's fused LM head (`add_fused_lm_head`: log-probs and entropy
  in tiles, no `[tokens, vocab]` logits), a deep copy as its reference model (what TRL makes for full
  fine-tuning with beta > 0). A step is what TRL's generation-batch step runs: the old log-probs and
  the reference's (`_get_per_token_logps_and_entropies`, no grad, one rollout at a time), the
  correction (TRL's formula, `_generate_and_score_completions`), then per rollout (micro-batch 1,
  the leanest) `_compute_loss` and its backward, and the AdamW step. The trainer object is built
  without its `__init__` (as TRL's own tests build it), with the attributes its loss reads.
- mop: `mop train`'s run on the same rows (`data.format = "rollouts"`), built and stepped as
  `mop train` does (`mop.testing.step.Trainer`) on 2 ranks of one thread each, its layout fitted
  by the fit (`mop.settle`) to each of `--mop-budgets` (`train.memory_budget`; "auto", the default:
  this machine's memory shared by the ranks), given only the data, the shape, fp32 and `--rl.beta`:
  one rollout per sequence (`data.seq_len` = L, `train.global_batch` = rollouts). Its
  step time adds the precomputed reference pass (`rl.reference = "precomputed"`, one no-grad pass
  over the batch, which an RL loop runs for each new batch); the old log-probs come from the
  step's own forward.

Reported per system and length: seconds per step (step 2; step 1 is a warm-up that gives the loss),
tokens per second (rollout tokens per step / s), the peak resident memory of each process over its
life (VmHWM: everything the process held, weights, optimizer state, activations, the allocator's
slack and the runtime's own), and step 1's loss, which must agree across the systems to fp32
rounding. A system stops at the first length whose peak passes `--budget-gib` (longer ones would
too); the longest length within it is reported. Times on this machine are noisy: compare the ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from mop.bench.grpo import corpus_byte_ids
from mop.bench.report import table, write_json
from mop.bench.shape import ANCHOR, add_shape_arguments, shape_overrides
from mop.testing import run_distributed

MOP_RANKS = 2
GIB = 1 << 30
SHIFT = 0.4  # nats, the largest per-rollout shift of the sampling log-probs
CORRECTION_MAX = 3.0  # the sequence_mask correction's bound, TRL's default and mop's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, **ANCHOR)
    parser.add_argument("--lengths", default="8192,16384,32768,65536",
                        help="tokens per rollout, comma-separated (default 8K-64K)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts of the one prompt per step (default 8)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--beta", type=float, default=0.04, help="the KL's weight (default 0.04)")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="per-process memory a length must fit")
    parser.add_argument("--systems", default="trl,mop", help="which to run, comma-separated (default both)")
    parser.add_argument("--mop-budgets", default="auto,1.5GiB",
                        help="mop's train.memory_budget per mop row, comma-separated: auto (this machine's, shared by "
                             "the ranks; the row named mop) and sizes (rows named mop@SIZE; default auto,1.5GiB)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/grpo_trl.json"))


def make_model(args, folder: Path) -> tuple[Path, Path]:
    """The transformers model saved (`folder/hf`) and its mop import (`folder/mop`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mop.config import load_config
    from mop.convert import import_hf
    from mop.models.hf import config_to_hf

    config = load_config(None, shape_overrides(args))
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_to_hf(config.model, "qwen3_moe"))).save_pretrained(folder / "hf")
    import_hf(folder / "hf", folder / "mop", "byte", None)
    return folder / "hf", folder / "mop"


def rollout_rows(args, length: int, hf_dir: Path, path: Path) -> None:
    """The rows of one length (module docstring), written to `path`."""
    completion = length - args.prompt
    ids = corpus_byte_ids(args.prompt + args.rollouts * completion)
    model = _hf_model(hf_dir).eval()
    rows = []
    for k in range(args.rollouts):
        tokens = np.concatenate([ids[:args.prompt], ids[args.prompt + k * completion:][:completion]])
        with torch.no_grad():
            own = _logps(model, torch.as_tensor(tokens)[None], completion)[0]
        shift = SHIFT * (2 * k / max(args.rollouts - 1, 1) - 1)
        rows.append({"prompt_ids": tokens[:args.prompt].tolist(), "completion_ids": tokens[args.prompt:].tolist(),
                     "sampling_logps": (own - shift / completion).tolist(), "reward": float(k), "group": 0})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")


def _logps(model, ids: torch.Tensor, completion: int) -> torch.Tensor:
    """The completion's per-token log-probs, one position's logits at a time (no `[tokens, vocab]`)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, -completion - 1:-1]
    out = torch.empty(ids.shape[0], completion)
    for start in range(0, completion, 4096):
        logits = model.lm_head(hidden[:, start:start + 4096])
        out[:, start:start + 4096] = logits.log_softmax(-1).gather(-1, ids[:, -completion:][:, start:start + 4096,
                                                                                             None])[..., 0]
    return out


class OneProcessAccelerator:
    """What TRL's loss reads of its accelerator, on one process (`tests/test_grpo_trl.py` uses it too)."""

    num_processes, is_main_process = 1, True

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def autocast(self):
        return nullcontext()


def trl_process(rank: int, world: int, hf_dir: str, rows_path: str, beta: float, lr: float,
                weight_decay: float, epsilon: tuple[float, float]) -> dict:
    """TRL's step (module docstring), twice: step 1's loss, step 2's seconds, the process's peak."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(2)  # the whole machine, as the 2 mop ranks of one thread each
    model = _hf_model(Path(hf_dir)).train()
    model.config.use_cache = False
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # 5.x
    enable({"use_reentrant": False})  # its checkpoint kwargs, named otherwise in each
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    add_fused_lm_head(reference)
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type="dapo", epsilon_low=epsilon[0], epsilon_high=epsilon[1], use_vllm=True,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=None,
        accelerator=OneProcessAccelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rows = [json.loads(line) for line in open(rows_path)]
    prompt = torch.tensor([rows[0]["prompt_ids"]] * len(rows))
    completion = torch.tensor([row["completion_ids"] for row in rows])
    sampling = torch.tensor([row["sampling_logps"] for row in rows])
    rewards = torch.tensor([row["reward"] for row in rows])
    ids, mask = torch.cat([prompt, completion], 1), torch.ones(len(rows), prompt.shape[1] + completion.shape[1])
    length = completion.shape[1]

    phases = {}

    def step() -> float:
        start = time.perf_counter()
        with torch.no_grad():  # TRL's generation-time passes
            old = trainer._get_per_token_logps_and_entropies(model, ids, mask, length, batch_size=1)[0]
            phases["old_logps_s"] = time.perf_counter() - start
            ref = trainer._get_per_token_logps_and_entropies(reference, ids, mask, length, batch_size=1)[0]
            phases["reference_s"] = time.perf_counter() - start - phases["old_logps_s"]
        rho = (old - sampling).sum(-1, keepdim=True).exp()  # sequence_mask, in [0, 3]
        rho = rho.masked_fill(rho > CORRECTION_MAX, 0.0)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # one group, scaled by its std
        total = 0.0
        for k in range(len(rows)):  # micro-batches of one rollout
            part = slice(k, k + 1)
            inputs = {"prompt_ids": prompt[part], "prompt_mask": torch.ones_like(prompt[part]),
                      "completion_ids": completion[part], "completion_mask": torch.ones_like(completion[part]),
                      "advantages": advantages[part], "old_per_token_logps": old[part],
                      "ref_per_token_logps": ref[part], "importance_sampling_ratio": rho[part],
                      "num_items_in_batch": torch.tensor(float(completion.numel()))}
            loss = trainer._compute_loss(model, inputs)
            loss.backward()
            total += float(loss.detach())
        phases["loss_and_backward_s"] = time.perf_counter() - start - phases["old_logps_s"] - phases["reference_s"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    loss = step()
    start = time.perf_counter()
    step()
    return {"s_per_step": time.perf_counter() - start, "loss": loss, "peak_bytes": _peak_resident(), **phases}


def mop_rank(rank: int, world: int, config_path: str, overrides: list[str]) -> dict:
    """mop's run (module docstring) on this rank: step 1's loss, step 2's seconds with the reference
    pass, this rank's peak, the layout the fit chose."""
    from mop.config import load_config
    from mop.settle import settle
    from mop.testing.step import Trainer

    torch.set_num_threads(1)
    config = settle(load_config(config_path, overrides), world)
    trainer = Trainer(config, rank, "packed")
    trainer.step()
    loss = trainer.record["loss"]
    start = time.perf_counter()
    trainer.step()
    step_s = time.perf_counter() - start
    p, train = config.parallel, config.train
    layout = (f"D={p.sequence} Ep={p.expert} P={p.vocab} ({p.vocab_logits} logits, {p.llep_chunks} LLEP and "
              f"{p.attention_head_chunks} head chunks), checkpointing {train.activation_checkpointing}"
              f"{' with offload' if train.offload_activations else ''}, micro-batch {train.micro_batch}, "
              f"{'host' if config.optim.offload else 'torch'} AdamW")
    return {"s_per_step": step_s + trainer.prepare_s, "reference_s": trainer.prepare_s, "train_step_s": step_s,
            "loss": loss, "peak_bytes": _peak_resident(), "layout": layout}


def _peak_resident() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mop_settings(args, length: int, rows: Path, checkpoint: Path, folder: Path, budget: str) -> list[str]:
    return [*shape_overrides(args), f"--parallel.nproc={MOP_RANKS}", "--train.device=cpu", "--train.dtype=float32",
            f"--train.memory_budget={budget}",
            "--data.format=rollouts", f"--data.source={rows}", "--data.tokenizer=byte", f"--data.seq_len={length}",
            f"--train.global_batch={args.rollouts}", f"--checkpoint.init={checkpoint}", "--model.aux_loss_coef=0",
            f"--rl.beta={args.beta}", f"--rl.reference_dir={folder / f'reference-{length}-{budget}'}",  # each its own
            f"--dpo.reference_dir={folder}"]


def run(args) -> dict:
    from mop.config import ConfigError, OptimConfig, RlConfig
    from mop.settle.budget import parse_budget

    lengths = [int(n) for n in args.lengths.split(",") if n]
    systems = [s for s in args.systems.split(",") if s]
    if any(n <= args.prompt for n in lengths) or not set(systems) <= {"trl", "mop"}:
        raise SystemExit(f"mop: error: --lengths must exceed --prompt {args.prompt}, --systems be trl and/or mop")
    optim, rl, rows, stopped = OptimConfig(), RlConfig(), [], set()
    epsilon = (rl.epsilon, rl.epsilon_high or rl.epsilon)
    # the rows' names: "trl", "mop" (the default budget) and "mop@BUDGET" for each other budget
    named = {"trl": ""} if "trl" in systems else {}
    if "mop" in systems:
        budgets = [b for b in args.mop_budgets.split(",") if b]
        for budget in budgets:
            try:
                parse_budget(budget)
            except ConfigError:
                raise ConfigError("--mop-budgets", f"{budget!r} is not a train.memory_budget; give sizes such as "
                                  "6.6GiB, or auto") from None
        named |= {("mop" if b == "auto" else f"mop@{b}"): b for b in budgets}
    with tempfile.TemporaryDirectory(prefix="mop-bench-grpo-trl-") as work:
        folder = Path(work)
        hf_dir, checkpoint = make_model(args, folder)
        for length in lengths:
            source = folder / f"rollouts-{length}.jsonl"
            if set(named) - stopped:
                rollout_rows(args, length, hf_dir, source)
            for system in [s for s in named if s not in stopped]:
                if system == "trl":
                    (out,) = run_distributed(trl_process, 1, str(hf_dir), str(source), args.beta, optim.lr,
                                             optim.weight_decay, epsilon, timeout=36000)
                else:
                    budget = named[system]
                    ranks = run_distributed(mop_rank, MOP_RANKS, str(checkpoint / "model.toml"),
                                            mop_settings(args, length, source, checkpoint, folder, budget),
                                            timeout=36000)
                    out = {**ranks[0], "budget": budget, "s_per_step": max(r["s_per_step"] for r in ranks),
                           "peak_bytes": max(r["peak_bytes"] for r in ranks)}
                out = {"system": system, "tokens": length, "peak_mib": out["peak_bytes"] / (1 << 20),
                       "tokens_per_s": args.rollouts * length / out["s_per_step"], **out}
                rows.append(out)
                print(f"mop bench grpo-trl: {system} at {length} tokens per rollout: {out['s_per_step']:.1f} s per "
                      f"step, peak {out['peak_mib']:.0f} MiB per process, loss {out['loss']:.9g}", flush=True)
                if out["peak_bytes"] > args.budget_gib * GIB:
                    stopped.add(system)
    return {"rows": rows, "longest_within_budget": {
        system: max((r["tokens"] for r in rows if r["system"] == system and r["peak_bytes"] <= args.budget_gib * GIB),
                    default=0) for system in named}}


def report(args, results: dict) -> None:
    trl = {r["tokens"]: r for r in results["rows"] if r["system"] == "trl"}
    lines = []
    for r in sorted(results["rows"], key=lambda r: (r["tokens"], r["system"] != "trl", r["system"])):
        base = trl.get(r["tokens"])
        against = ([base["s_per_step"] / r["s_per_step"], r["peak_mib"] / base["peak_mib"],
                    f"{r['loss'] - base['loss']:.2g}"] if base and r is not base else ["", "", ""])
        lines.append([r["tokens"], r["system"], r["s_per_step"], r["tokens_per_s"], r["peak_mib"],
                      f"{r['loss']:.9g}", *against])
    print(table(f"mop bench grpo-trl: {args.rollouts} rollouts of one {args.prompt}-token prompt per step, dapo, KL "
                f"beta {args.beta}, sequence_mask correction, fp32; TRL 1.16 on one process of 2 threads, mop on "
                f"{MOP_RANKS} ranks of 1 fitted to train.memory_budget (peak resident memory per process)",
                ["tokens/rollout", "system", "s/step", "tokens/s", "peak MiB", "loss (step 1)", "speed-up",
                 "memory / trl", "loss - trl"], lines))
    for r in results["rows"]:
        if r["system"] != "trl":
            print(f"{r['system']} at {r['tokens']}: the fit chose {r['layout']}; {r['reference_s']:.1f} s of its step "
                  "are its start (the checkpoint's weights and the reference pass)")
    budget = ", ".join(f"{s} {n}" for s, n in results["longest_within_budget"].items())
    print(f"longest rollout within {args.budget_gib:g} GiB per process: {budget}; the loss differs by the sequence "
          "correction's exp of a sum over the completion, which carries each token's fp32 rounding")
    print(f"wrote {write_json(args.out, 'grpo-trl', vars(args) | {'out': str(args.out)}, results)}")
