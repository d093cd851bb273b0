"""Benchmark programs, run as `mop bench NAME`: each prints a table and writes JSON.

A benchmark module provides `add_arguments(parser)`, `run(args) -> dict` and
`report(args, results)`; every comparison is against a baseline measured in the same run. A
module is imported only when its benchmark is asked for (`load`), so `mop --help` and training
never pay for the benchmarks' imports.
"""

import importlib

# name -> one line for `mop bench --help`
BENCHMARKS = {
    "attention": "per-rank activation memory and time of the dense path against sequence length",
    "build": "the resident memory of building a real preset's model: shards only against the full model first",
    "context": "`mop train` at long packed-document context, and plain FSDP2 on Hugging Face's model",
    "data": "chat data: mop data prepare on a generated conversation file (tokens/s, memory) and a run's start-up on it",
    "dpo": "DPO at long context: per-rank memory and step time with the prompt computed once against repeated",
    "e2e": "training throughput and per-rank memory of mop and of the best fsdp2 setup, against context",
    "gpu": "acceptance test of 1-8 GPUs: the CUDA tier and bf16 trainings sized to the GPUs and host (--dry-run: the plan)",
    "grpo": "GRPO on long recorded rollouts: per-rank memory and tokens/s with routing replay on against off",
    "grpo-trl": "the GRPO step on long rollouts, mop's against TRL's: seconds, peak memory per process and loss",
    "lora": "per-rank device memory and step time of LoRA over an fp8 base against full fine-tuning",
    "moe": "the expert layer under skewed routing for EP, LLEP and chunked LLEP",
    "optimizer": "the host optimizer's update throughput and how much of it the step exposes",
    "rl-sync": "the trainer's weights exported for an engine: seconds and peak memory per rank against the bucket size",
    "plan": "the paper's Table 1 as `mop plan` predicts it (3 models on 2/8/12 H200 nodes, 64K-1M), beside the paper",
    "vocab": "the output projection + loss, per rank, for three ways of computing it",
}


def load(name: str):
    """The module of benchmark `name`."""
    return importlib.import_module(f"mop.bench.{name.replace('-', '_')}")
