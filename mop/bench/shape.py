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


def add_shape_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """`--NAME` (integer, with `defaults[NAME]`) for each named shape option, in the order given."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default,
                            help=f"{HELP[name]} (default {default})")
