"""Rollouts sampled on this machine from a model, written as the rows `data.format = "rollouts"` reads
(`mop.data.rollouts.rows`): what the tests and the shipped debug rollouts are made with, standing in for
an inference engine (vLLM, SGLang) on a machine without one.

For each prompt, `group` completions are drawn together (multinomial at temperature 1, from a seeded
generator, `max_new` tokens or up to the end-of-text token), then one forward over each whole
sequence gives what an engine returns with them: each completion token's log-probability (fp32,
`sampling_logps`) and each token's experts per layer (`routed_experts`, vLLM's form: `[tokens - 1,
layers, top_k]`, the dense layers' rows 0 as vLLM writes them). A reward function scores each
completion; the rows carry the reward and the prompt's group, so the trainer computes the advantages.

The shipped debug rollouts (`mop/data/corpus/rollouts.jsonl`, what `configs/debug-grpo.toml` trains on)
are those of the debug model's initial weights on the byte tokenizer, rewarded by the share of
lowercase letters in the completion (a signal that varies between random completions):

    python -m mop.objectives.policy_gradient.sampling configs/debug.toml mop/data/corpus/rollouts.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from mop.models.moe import MoE
from mop.models.transformer import MoETransformer

PROMPTS = ("Write a word:", "Name a color:", "Say hello:", "Count to three:", "Spell cat:", "A fruit:",
           "The sky is", "Once upon a time", "Q: 2+2=? A:", "Translate 'chat':", "List two animals:",
           "Finish: the quick brown", "Your name?", "Rhyme with 'blue':", "Opposite of up:", "Describe rain:")


def lowercase_share(completion: bytes) -> float:
    """The debug reward: the share of a completion's bytes that are lowercase ASCII letters."""
    return sum(97 <= b <= 122 for b in completion) / max(len(completion), 1)


@torch.no_grad()
def sample_group(model: MoETransformer, prompt: list[int], group: int, max_new: int, eos_id: int,
                 generator: torch.Generator) -> list[list[int]]:
    """`group` completions of one prompt, each cut after its first end-of-text token."""
    sequences = torch.tensor([prompt] * group)
    for _ in range(max_new):
        logits = model(sequences)[:, -1].float()
        drawn = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        sequences = torch.cat([sequences, drawn], 1)
    completions = []
    for row in sequences[:, len(prompt):].tolist():
        completions.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
    return completions


@torch.no_grad()
def engine_view(model: MoETransformer, ids: list[int], prompt: int) -> tuple[list[float], list]:
    """One sequence's completion log-probs and its routes `[tokens - 1, layers, top_k]` (module docstring)."""
    chosen = []
    hooks = [m.router.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
             for m in model.modules() if isinstance(m, MoE)]
    try:
        logits = model(torch.tensor([ids]))[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    logps = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    cfg = model.cfg
    routes = torch.zeros(len(ids), cfg.layers, cfg.top_k, dtype=torch.long)
    routes[:, cfg.dense_layers:] = torch.stack(chosen, 1)
    return logps[prompt - 1:].tolist(), routes[:-1].tolist()


def rollout_rows(model: MoETransformer, prompts: list[list[int]], group: int, max_new: int, eos_id: int,
                 reward: Callable[[list[int]], float], seed: int) -> list[dict]:
    """The rows of `group` rollouts per prompt (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for number, prompt in enumerate(prompts):
        for completion in sample_group(model, prompt, group, max_new, eos_id, generator):
            logps, routes = engine_view(model, prompt + completion, len(prompt))
            rows.append({"prompt_ids": prompt, "completion_ids": completion, "sampling_logps": logps,
                         "reward": reward(completion), "group": number, "routed_experts": routes})
    return rows


def main(argv: list[str] | None = None) -> None:
    from mop.config import load_config
    from mop.data.tokenizer import load_tokenizer
    from mop.models.transformer import build_model

    parser = argparse.ArgumentParser(description="Sample rollouts of a config's model at its initial weights.")
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=24)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    model = build_model(config.model, config.train.seed).eval()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    rows = rollout_rows(model, prompts, args.group, args.max_new, tokenizer.eos_id,
                        lambda ids: lowercase_share(bytes(i for i in ids if i < 256)), config.train.seed)
    Path(args.out).write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    print(f"mop: {len(rows)} rollouts of {len(prompts)} prompts written to {args.out}")


if __name__ == "__main__":
    main()
