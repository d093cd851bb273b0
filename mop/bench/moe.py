"""`mop bench moe`: the expert layer under skewed routing for EP, LLEP and chunked LLEP.

Scenarios follow the LLEP paper: balanced routing, and x% of the token-expert assignments spread
evenly over n hot experts (x in 30/50/80/95, n in 1/4/16), the rest uniform over all experts. The
hot experts are experts 0..n-1, which all live on rank 0, as routing collapse tends to do.

For each scenario and variant, W ranks (one expert group, one intra-op thread each) run the
expert layer (dispatch, expert GEMMs, combine) forward + backward on their own tokens, twice:
bare (as `mop train` runs it without activation checkpointing) and inside a checkpointed block
(`mop.parallel.checkpointing.checkpoint_block`, as with `train.activation_checkpointing=full`,
which a run that needs chunked LLEP's memory saving will usually have on). Bare, chunked LLEP
re-runs the gate and up projections in its backward where LLEP keeps their outputs; in a
checkpointed block LLEP re-runs its whole forward in the block's recomputation and chunked LLEP
does not (it returns its kept output), so there chunked LLEP computes fewer expert FLOPs (11
GEMMs' worth per row against 12). Reported per scenario and mode: time (mean after a warm-up,
the slowest rank, which is what a step waits for), the hot rank's transient peak memory (`mop.testing.memory`: every tensor created during forward +
backward, weights and inputs excluded), and the max/mean token load over ranks after the plan.
Ratios are against EP in the same scenario of the same run.

Honest skew. A token picks k distinct experts, so with n < k hot experts at most n of its k
assignments can be hot: "95% -> 1" at k = 4 realises at most 25%, not 95% (the LLEP paper's
generator repeats the hot expert within a token, which no router does). Next to each scenario
the report gives the realised share of assignments on the hot experts and EP's max/mean rank
load, and orders the scenarios by that load, so results read against the paper's figures by the
imbalance they actually realise.

Real layers (`--model`): the LLEP paper's section 5.1 measures the expert layers of gpt-oss-120b,
DeepSeek-V3 and Kimi-K2 on 8 H200s. `--model NAME` takes a preset's experts, top-k, width and
expert width (`configs/NAME.toml`, the one owner of those shapes), the two widths divided by
`--width-divisor` (default 16) so that a CPU layer takes seconds; the expert count and top-k are
the model's. Tokens per rank stay `--tokens` (the paper: 32K for gpt-oss, 16K for the others) and
the world `--world` (the paper: 8). The report's title names the shape it ran.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import add_shape_arguments
from mop.config import ConfigError
from mop.models.config import ModelConfig
from mop.models.moe import Experts
from mop.models.transformer import init_weights
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import checkpoint_block
from mop.parallel.llep import BalanceOptions, ExpertParallel
from mop.testing import run_distributed
from mop.testing.memory import measure_step, preallocate_grads
from mop.testing.routing import SCENARIOS, skewed_routing

MODES = ("bare", "checkpointed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks (one expert group)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    add_shape_arguments(parser, hidden=256, intermediate=512, experts=32, top_k=2)
    parser.add_argument("--min-chunk", type=int, default=256, help="LLEP m (the paper's 1024 is for 16-32K tokens per GPU)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks of the memory-efficient variant")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(name for name, _, _ in SCENARIOS),
                        help="the scenarios to run, comma-separated (default: all)")
    parser.add_argument("--model", default=None,
                        help="a preset (e.g. gpt-oss-120b, deepseek-v3, kimi-k2) whose MoE layer shape replaces "
                             "--experts, --top-k, --hidden and --intermediate (widths divided by --width-divisor)")
    parser.add_argument("--width-divisor", type=int, default=16, help="with --model: the widths are divided by this")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/moe.json"))


def layer_shape(args) -> None:
    """With `--model`, the preset's expert layer (widths divided by `--width-divisor`) in `args`."""
    if args.model is None:
        return
    from mop.plan import load_model, presets

    if args.model not in presets():
        raise ConfigError("--model", f"{args.model!r} is not a preset; use one of {', '.join(presets())}")
    if args.width_divisor < 1:
        raise ConfigError("--width-divisor", f"must be >= 1, got {args.width_divisor}")
    model = load_model(args.model)
    args.experts, args.top_k = model.experts, model.top_k
    args.hidden = max(model.hidden // args.width_divisor, 1)
    args.intermediate = max(model.expert_intermediate // args.width_divisor, 1)


def expert_rank(rank, world, cfg: ModelConfig, scenario, options: BalanceOptions, tokens: int, repeats: int,
                mode: str) -> dict:
    layout = DistLayout(Layout(world, expert=world), torch.device("cpu"))
    experts = Experts(cfg)
    init_weights(experts, seed=0, std=0.02)
    module = ExpertParallel(experts, layout, options)
    del experts
    preallocate_grads(module)
    expert_ids, weights = skewed_routing(scenario, tokens, cfg.experts, cfg.top_k, seed=rank)
    x = torch.randn(tokens, cfg.hidden, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
    weights.requires_grad_()

    def step():
        if mode == "checkpointed":
            checkpoint_block(module, x, expert_ids, weights, offload=None).sum().backward()
        else:
            module(x, expert_ids, weights).sum().backward()

    measured = measure_step(step, repeats)
    record = module.records[-1]
    hot = scenario[2]
    return {**measured, "hot_assignments": int((expert_ids < hot).sum()), "assignments": expert_ids.numel(),
            "rank_load_imbalance": record["rank_load_imbalance_after"],
            "rank_load_imbalance_ep": record["rank_load_imbalance_before"],
            "weight_bytes_moved": record["weight_bytes_moved"]}


def chosen_scenarios(args) -> list[tuple]:
    """The scenarios `--scenarios` names, each with no more hot experts than `--experts`."""
    known = {scenario[0]: scenario for scenario in SCENARIOS}
    names = [name.strip() for name in args.scenarios.split(",")]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError("--scenarios", f"unknown scenario {unknown[0]!r}; use some of {', '.join(known)}")
    chosen = [known[name] for name in names]
    hot = max(scenario[2] for scenario in chosen)
    if args.experts < hot:
        raise ConfigError("--experts", f"{args.experts} is fewer than the {hot} hot experts of the chosen scenarios; "
                                       f"use --experts >= {hot}")
    return chosen


def run(args) -> dict:
    layer_shape(args)
    scenarios = chosen_scenarios(args)
    cfg = ModelConfig(hidden=args.hidden, experts=args.experts, top_k=args.top_k, expert_intermediate=args.intermediate)
    variants = {"ep": BalanceOptions("ep"),
                "llep": BalanceOptions("llep", min_chunk=args.min_chunk),
                f"llep chunks={args.chunks}": BalanceOptions("llep", min_chunk=args.min_chunk, chunks=args.chunks)}
    rows = []
    for scenario in scenarios:
        for mode in MODES:
            base = None
            for name, options in variants.items():
                per_rank = run_distributed(expert_rank, args.world, cfg, scenario, options, args.tokens, args.repeats,
                                           mode, timeout=1800)
                result = {"seconds": max(r["seconds"] for r in per_rank),
                          "realised_hot_share": sum(r["hot_assignments"] for r in per_rank) / sum(
                              r["assignments"] for r in per_rank),
                          "ep_rank_load_imbalance": per_rank[0]["rank_load_imbalance_ep"],
                          "hot_rank_peak_bytes": per_rank[0]["peak_bytes"],
                          "max_rank_peak_bytes": max(r["peak_bytes"] for r in per_rank),
                          "rank_load_imbalance": per_rank[0]["rank_load_imbalance"],
                          "weight_bytes_moved": per_rank[0]["weight_bytes_moved"]}
                base = base or result
                rows.append({"scenario": scenario[0], "mode": mode, "variant": name, **result,
                             "speedup_vs_ep": base["seconds"] / result["seconds"],
                             "hot_peak_vs_ep": result["hot_rank_peak_bytes"] / base["hot_rank_peak_bytes"]})
    return {"rows": rows}


def report(args, results: dict) -> None:
    rows = results["rows"]
    order = sorted({r["scenario"]: r["ep_rank_load_imbalance"] for r in rows}.items(), key=lambda item: item[1])
    by = {(r["scenario"], r["mode"], r["variant"]): r for r in rows}
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    chunked = variants[-1]
    for mode in MODES:
        model = f"{args.model}'s layer, widths / {args.width_divisor}: " if args.model else ""
        print(table(f"{model}expert layer forward + backward ({mode}), W={args.world}, {args.tokens} tokens/rank, "
                    f"E={args.experts}, k={args.top_k}, H={args.hidden}, I={args.intermediate}; scenarios ordered by "
                    "EP's max/mean rank load",
                    ["scenario", "hot share", "EP load", "variant", "time s", "speedup vs EP", "hot rank peak MiB",
                     "vs EP", "max/mean rank load", "weights moved MiB"],
                    [[name, by[(name, mode, v)]["realised_hot_share"], load, v, by[(name, mode, v)]["seconds"],
                      by[(name, mode, v)]["speedup_vs_ep"], by[(name, mode, v)]["hot_rank_peak_bytes"] / MIB,
                      by[(name, mode, v)]["hot_peak_vs_ep"], by[(name, mode, v)]["rank_load_imbalance"],
                      by[(name, mode, v)]["weight_bytes_moved"] / MIB] for name, load in order for v in variants]))
        print()

    def against_llep(name: str, mode: str, key: str) -> float:
        return by[(name, mode, chunked)][key] / by[(name, mode, "llep")][key]

    print(table(f"{chunked} against llep, bare and in a checkpointed block (target: time <= 1.10x at hot-rank "
                "peak <= 0.55x)",
                ["scenario", "hot share", "EP load", "time vs llep", "peak vs llep", "checkpointed: time vs llep",
                 "checkpointed: peak vs llep"],
                [[name, by[(name, "bare", chunked)]["realised_hot_share"], load,
                  against_llep(name, "bare", "seconds"), against_llep(name, "bare", "hot_rank_peak_bytes"),
                  against_llep(name, "checkpointed", "seconds"),
                  against_llep(name, "checkpointed", "hot_rank_peak_bytes")] for name, load in order]))
    path = write_json(args.out, "moe", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
