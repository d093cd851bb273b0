"""The model-shape options the benchmarks share (`--hidden`, `--heads`, ...), each benchmark with its
own defaults: one owner for their names, types and help."""

from __future__ import annotations

import argparse

HELP = {
    "vocab": "vocabulary size",
    "hidden": "model width H",
    "layers": "transformer blocks",
    "heads": "query heads",
    "kv_heads": "key/value heads",
    "head_dim": "width of one attention head",
    "experts": "routed experts",
    "top_k": "experts each token is routed to",
    "intermediate": "expert intermediate width",
}


# The HF+FSDP2 anchor's model (`mop bench context`), the shape the LoRA and DPO benchmarks train
ANCHOR = dict(vocab=32000, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=16, top_k=2,
              intermediate=256)


def add_shape_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """`--NAME` (integer, with `defaults[NAME]`) for each named shape option, in the order given."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default,
                            help=f"{HELP[name]} (default {default})")


# `mop train`'s model settings for the shape options that name one (model.<key>)
MODEL_KEYS = {"vocab": "vocab_size", "hidden": "hidden", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads",
              "head_dim": "head_dim", "experts": "experts", "top_k": "top_k", "intermediate": "expert_intermediate"}


def shape_overrides(args) -> list[str]:
    """`--model.KEY=VALUE` for every shape option `args` holds."""
    return [f"--model.{key}={getattr(args, name)}" for name, key in MODEL_KEYS.items() if hasattr(args, name)]
