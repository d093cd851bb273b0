"""The `mop` command: `mop train [CONFIG.toml] [--section.key=value ...]`, `mop rl CONFIG.toml [...]` (the
RL loop), `mop bench NAME [...]`,
`mop convert to-hf|from-hf ...`, `mop plan ...`, `mop data prepare SOURCE --tokenizer DIR --out DIR`,
`mop data inspect SOURCE --tokenizer DIR` (both with `--format preference` for preference pairs).

User errors (a bad setting, missing data, an impossible layout, a feature that has not landed)
print one line naming the setting and the fix, and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import sys
import typing

from mop.bench import BENCHMARKS
from mop.bench import load as load_benchmark
from mop.bench.child import stop_on_sigterm
from mop.config import Config, ConfigError, DataConfig, field_docs, hints, load_config, sections
from mop.faults import PeerLost
from mop.launch import RUN_ENDED, USER_ERRORS, failed_launch, launch, say_run_ended
from mop.runtime import under_torchrun
from mop.settle import settle
from mop.train import train


def config_reference() -> str:
    """Every setting with its default and docstring, for `mop train --help`."""
    lines, defaults = ["settings (override as --section.key=value):"], Config()
    for section, cls in sections().items():
        docs = field_docs(cls)
        lines.append(f"  [{section}]")
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            kind = hints(cls)[f.name]
            choices = "|".join(map(str, typing.get_args(kind))) if typing.get_origin(kind) is typing.Literal else ""
            lines.append(f"    {section}.{f.name} = {default!r}{'  (' + choices + ')' if choices else ''}")
            lines.append(f"        {docs.get(f.name, '')}")
        if section == "model":
            lines += family_options_reference()
    return "\n".join(lines)


def family_options_reference() -> list[str]:
    """Each family's own keys (`[model.options]`), with their defaults and docstrings."""
    from mop.models.families import FAMILIES

    lines = []
    for family in FAMILIES.values():
        if family.options:
            docs = field_docs(family.options)
            lines.append(f"    with model.family = {family.name!r}:")
            for f in dataclasses.fields(family.options):
                lines.append(f"      model.options.{f.name} = {getattr(family.options(), f.name)!r}")
                lines.append(f"          {docs.get(f.name, '')}")
    return lines


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
    rl_parser = commands.add_parser(
        "rl", help="the RL loop: the engine samples rollouts of rl.prompts with the current weights, a reward "
        "scores them, the policy trains on them (mop.rl)",
        description="Train with reinforcement learning: `mop train` with data.format = rollouts drawn each batch by "
        "the inference engine from rl.prompts (e.g. configs/debug-rl.toml); every setting of mop train applies.",
        epilog="see mop train --help for the settings ([rl] holds the loop's)")
    rl_parser.add_argument("config", nargs="?", help="TOML config file with [rl] prompts (e.g. configs/debug-rl.toml)")
    from mop import convert

    convert.add_arguments(commands.add_parser("convert", help="convert between mop checkpoints and Hugging Face "
                                              "model directories", description=convert.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    from mop import plan

    plan.add_arguments(commands.add_parser("plan", help="will a model fit a cluster at a context, with which layout "
                                           "and how fast (MoP and FSDP-best)", description=plan.__doc__,
                                           formatter_class=argparse.RawDescriptionHelpFormatter))
    data_parser = commands.add_parser("data", help="prepare conversations or preference pairs once for fine-tuning, "
                                      "or look at what training sees of them")
    data_commands = data_parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    from mop.data import kinds, prepared

    kinds.add_arguments(data_commands.add_parser(
        "prepare", help="render, tokenize and mask conversations (or preference pairs) into a memory-mapped "
        "prepared folder",
        description=prepared.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from mop.data import inspection

    inspection.add_arguments(data_commands.add_parser(
        "inspect", help="show conversations (or preference pairs) as training sees them, the trained tokens "
        "marked",
        description=inspection.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter), DataConfig())
    bench_parser = commands.add_parser("bench", help="run a benchmark: prints a table and writes JSON")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, summary in BENCHMARKS.items():
        sub = benchmarks.add_parser(name, help=summary, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == benchmark:
            module = load_benchmark(name)
            sub.description = module.__doc__
            module.add_arguments(sub)
    return parser


def run_train(config_path: str | None, overrides: list[str], command: str = "train") -> None:
    config = load_config(config_path, overrides)
    if command == "rl":
        config = rl_config(config)
    if under_torchrun():  # resolved for the world torchrun started, once the ranks have joined
        train(config, say_peer_lost=True)
        return
    config = settle(config)
    if config.parallel.strategy == "reference":
        train(config)
    else:
        launch(config)


def rl_config(config: Config) -> Config:
    """`mop rl`'s run: `mop train`'s on the rollouts the loop draws from rl.prompts."""
    if not config.rl.prompts:
        raise ConfigError("rl.prompts", "mop rl samples rollouts of prompts: set [rl] prompts to a jsonl of "
                          "{\"prompt\": ..., \"answer\": ...} rows (configs/debug-rl.toml has one)")
    return dataclasses.replace(config, data=dataclasses.replace(config.data, format="rollouts"))


def run_plan(args) -> None:
    from mop import plan

    plan.show(args, plan.run(args))


def run_bench(args) -> None:
    module = load_benchmark(args.benchmark)
    with stop_on_sigterm():  # its child runs end with it (`mop.bench.child`)
        module.report(args, module.run(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[1] if len(argv) > 1 and argv[0] == "bench" else None)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("bench", "convert", "plan", "data"):
        if rest:
            parser.error(f"unrecognised arguments: {' '.join(rest)}")
        from mop import convert

        try:
            from mop.data import inspection, kinds

            data = {"prepare": kinds.run, "inspect": inspection.run}
            {"bench": run_bench, "convert": convert.run, "plan": run_plan,
             "data": lambda args: data[args.data_command](args)}[args.command](args)
        except USER_ERRORS as err:
            print(f"mop: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM during a benchmark (`mop.bench.child.Stopped`)
            signum = getattr(stop, "signum", signal.SIGINT)
            print(f"mop: {args.command} stopped by {signal.Signals(signum).name}", file=sys.stderr)
            return 128 + signum
        except BrokenPipeError:  # the reader went away (`mop data inspect ... | head`): stop quietly, as cat does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail too
            return 128 + signal.SIGPIPE
        return 0
    unknown = [arg for arg in rest if not (arg.startswith("--") and "." in arg.split("=", 1)[0])]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (settings look like --section.key=value)")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run_train(args.config, rest, args.command)
    except USER_ERRORS as err:
        print(f"mop: error: {err}", file=sys.stderr)
        return 2
    except RUN_ENDED as ended:  # one process (the reference strategy, or a rank under torchrun)
        return say_run_ended(ended)
    except PeerLost as lost:  # a rank under torchrun (its node's first rank said it)
        return lost.exit_code
    except ChildFailedError as err:
        code, line = failed_launch(err.failures)
        if line:
            print(line, file=sys.stderr)
        return code
    except SignalException as err:  # the launcher itself was signalled; its ranks said what they saved
        return 128 + err.sigval
    finally:
        gc.collect()  # a failed run freed while the interpreter is whole (`mop.launch.leave`)
    return 0

if __name__ == "__main__":
    sys.exit(main())
