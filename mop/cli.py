"""The `mop` command: `mop train [CONFIG.toml] [--section.key=value ...]`, `mop bench NAME [...]`,
`mop convert to-hf|from-hf ...`.

User errors (a bad setting, missing data, an impossible layout, a feature that has not landed)
print one line naming the setting and the fix, and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import typing

from mop.bench import BENCHMARKS
from mop.bench import load as load_benchmark
from mop.config import Config, field_docs, load_config, sections
from mop.launch import NOTHING_TO_TRAIN, USER_ERRORS, launch
from mop.runtime import under_torchrun
from mop.train import NothingToTrain, train


def config_reference() -> str:
    """Every setting with its default and docstring, for `mop train --help`."""
    lines, defaults = ["settings (override as --section.key=value):"], Config()
    for section, cls in sections().items():
        docs = field_docs(cls)
        lines.append(f"  [{section}]")
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            kind = typing.get_type_hints(cls)[f.name]
            choices = "|".join(map(str, typing.get_args(kind))) if typing.get_origin(kind) is typing.Literal else ""
            lines.append(f"    {section}.{f.name} = {default!r}{'  (' + choices + ')' if choices else ''}")
            lines.append(f"        {docs.get(f.name, '')}")
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line too (argparse would print the usage first), pointing at the help;
    sub-commands inherit it."""

    def error(self, message: str):
        self.exit(2, f"mop: error: {message}; see {self.prog} --help\n")


def build_parser(benchmark: str | None = None) -> argparse.ArgumentParser:
    """The command line; `benchmark`: the one `mop bench` runs, whose module (and arguments) alone is loaded."""
    parser = OneLineParser(prog="mop", description="Mixture-of-Parallelisms training stack for MoE models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_parser = commands.add_parser(
        "train", help="train a model (no arguments: the tiny debug model on the shipped corpus)",
        description="Train an MoE language model. With no arguments: the debug model on the shipped corpus, on CPU.",
        epilog=config_reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train_parser.add_argument("config", nargs="?", help="TOML config file (e.g. configs/debug.toml); defaults apply without one")
    from mop import convert

    convert.add_arguments(commands.add_parser("convert", help="convert between mop checkpoints and Hugging Face "
                                              "model directories", description=convert.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    bench_parser = commands.add_parser("bench", help="run a benchmark: prints a table and writes JSON")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, summary in BENCHMARKS.items():
        sub = benchmarks.add_parser(name, help=summary, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == benchmark:
            module = load_benchmark(name)
            sub.description = module.__doc__
            module.add_arguments(sub)
    return parser


def run_train(config_path: str | None, overrides: list[str]) -> None:
    config = load_config(config_path, overrides)
    if under_torchrun() or config.parallel.strategy == "reference":
        train(config)
    else:
        launch(config)


def run_bench(args) -> None:
    module = load_benchmark(args.benchmark)
    module.report(args, module.run(args))


def launch_failure(failures: dict) -> str:
    """One line on why launched ranks failed: a rank killed by SIGKILL without a traceback was, on
    Linux, almost always stopped by the out-of-memory killer, which is what to say then."""
    ranks = ", ".join(map(str, sorted(failures)))
    if any(failure.exitcode == -signal.SIGKILL for failure in failures.values()):
        return (f"rank(s) {ranks} failed and at least one was killed by SIGKILL, usually the out-of-memory killer: "
                "lower data.seq_len or train.micro_batch, or set train.activation_checkpointing=full, "
                "train.offload_activations=true and raise parallel.sequence / parallel.attention_head_chunks / "
                "parallel.llep_chunks")
    return f"rank(s) {ranks} failed; their tracebacks are above"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[1] if len(argv) > 1 and argv[0] == "bench" else None)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("bench", "convert"):
        if rest:
            parser.error(f"unrecognised arguments: {' '.join(rest)}")
        if args.command == "bench":
            try:
                run_bench(args)
            except USER_ERRORS as err:
                print(f"mop: error: {err}", file=sys.stderr)
                return 2
            return 0
        from mop import convert

        try:
            convert.run(args)
        except USER_ERRORS as err:
            print(f"mop: error: {err}", file=sys.stderr)
            return 2
        return 0
    unknown = [arg for arg in rest if not (arg.startswith("--") and "." in arg.split("=", 1)[0])]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (settings look like --section.key=value)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run_train(args.config, rest)
    except USER_ERRORS as err:
        print(f"mop: error: {err}", file=sys.stderr)
        return 2
    except NothingToTrain as done:
        print(f"mop: {done}", file=sys.stderr)
        return NOTHING_TO_TRAIN
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if codes in ({2}, {NOTHING_TO_TRAIN}):
            return codes.pop()  # a user error or a finished run, already said by rank 0
        print(f"mop: error: {launch_failure(err.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
