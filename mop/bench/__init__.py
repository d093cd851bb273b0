"""Benchmark programs, run as `mop bench NAME`: each prints a table and writes JSON.

A benchmark module provides `add_arguments(parser)`, `run(args) -> dict` and
`report(args, results)`; every comparison is against a baseline measured in the same run.
"""

from mop.bench import attention, build, context, e2e, gpu, moe, optimizer, vocab

BENCHMARKS = {"attention": attention, "build": build, "context": context, "e2e": e2e, "gpu": gpu, "moe": moe, "optimizer": optimizer, "vocab": vocab}
