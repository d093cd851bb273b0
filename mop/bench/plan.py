"""`mop bench plan`: the paper's Table 1 as `mop plan` predicts it, beside the paper's measurements.

The paper's three models (`configs/mop-120b.toml`, `mop-600b.toml`, `mop-1t.toml`) on the paper's
clusters (2, 8 and 12 nodes of 8 H200) at 64K to 1M tokens: for each context, `mop plan`'s chosen
MoP layout and FSDP-best configuration (`mop.plan.search.plan`, exactly what `mop plan
--contexts` prints), their predicted peak device memory and tokens/s/GPU, against the paper's
measured tokens/s/GPU (its Table 1; "OOM" where its baseline ran out of memory, "-" where it has
no row). Nothing is trained: the numbers are the planner's (memory model and roofline, see
`mop.plan`), and the paper's are transcribed. The "fit" column says whether the planner agrees
with the paper on which system fits; where it does not, the binding column names the term that
decides it (the largest row at the peak moment of the closest layout that does not fit).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mop.bench.report import table, write_json
from mop.config import ConfigError
from mop.cost.cluster import GIB

CLUSTERS = {"mop-120b": 2, "mop-600b": 8, "mop-1t": 12}
# The paper's Table 1: (model, context) -> (MoP tokens/s/GPU, FSDP-best tokens/s/GPU or None for OOM).
PAPER = {
    ("mop-120b", 131072): (1043, 223), ("mop-120b", 262144): (681, None), ("mop-120b", 524288): (424, None),
    ("mop-120b", 1048576): (393, None),
    ("mop-600b", 65536): (236, 39), ("mop-600b", 131072): (220, None), ("mop-600b", 262144): (225, None),
    ("mop-600b", 524288): (213, None), ("mop-600b", 1048576): (213, None),
    ("mop-1t", 131072): (166, 25), ("mop-1t", 262144): (140, 17), ("mop-1t", 524288): (108, None),
    ("mop-1t", 1048576): (100, None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default="h200", help="node preset (the paper: h200)")
    parser.add_argument("--mfu", type=float, default=None, help="assumed MFU (default: mop plan's)")
    parser.add_argument("--document-tokens", default="0", help="packed documents' length (default: the context)")
    parser.add_argument("--models", default=",".join(CLUSTERS), help="which of the paper's models, comma-separated")
    parser.add_argument("--contexts", default="64K,128K,256K,512K,1M", help="which contexts, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/plan.json"))


def run(args) -> dict:
    from mop.cost.cluster import make_cluster
    from mop.plan import document_tokens, load_model, parse_token_list
    from mop.plan.report import plan_json
    from mop.plan.search import plan

    documents = document_tokens(args.document_tokens)
    names = args.models.split(",")
    unknown = [name for name in names if name not in CLUSTERS]
    if unknown:
        raise ConfigError("--models", f"{unknown[0]!r} is not one of the paper's models; use {', '.join(CLUSTERS)}")
    contexts = parse_token_list(args.contexts, "--contexts")
    rows = []
    for name in names:
        model, cluster = load_model(name), make_cluster(args.gpu, CLUSTERS[name], 8, mfu=args.mfu)
        for context in contexts:
            predicted = plan_json(context, plan(model, cluster, context, document_tokens=documents))
            paper = PAPER.get((name, context))
            rows.append({"model": name, "nodes": CLUSTERS[name], **predicted,
                         "paper": None if paper is None else {"mop": paper[0], "fsdp2_best": paper[1]}})
    return {"rows": rows}


def _fit_agreement(row: dict) -> str:
    paper = row["paper"]
    if paper is None:
        return "-"
    same = row["mop"]["fits"] and row["fsdp2_best"]["fits"] == (paper["fsdp2_best"] is not None)
    return "agree" if same else "DISAGREE"


def _binding(row: dict) -> str:
    """What decides the row: the limit of a system that does not fit, or whose fit the paper
    contradicts (FSDP-best first), else MoP's."""
    paper = row["paper"] or {}
    for name in ("fsdp2_best", "mop"):
        said = paper.get(name, 0) is not None if paper else row[name]["fits"]
        if not row[name]["fits"] or row[name]["fits"] != said:
            return f"{'FSDP-best' if name == 'fsdp2_best' else 'MoP'}: {row[name]['binding']}"
    return f"MoP: {row['mop']['binding']}"


def report(args, results: dict) -> None:
    from mop.plan.report import speed_cell, tokens

    body = []
    for r in results["rows"]:
        paper = r["paper"] or {}
        body.append([r["model"], r["nodes"], tokens(r["context"]), speed_cell(r["mop"]), paper.get("mop", "-"),
                     f"{r['mop']['peak_device_bytes'] / GIB:.0f}", speed_cell(r["fsdp2_best"]),
                     ("OOM" if paper.get("fsdp2_best", 0) is None else paper.get("fsdp2_best", "-")),
                     f"{r['speedup']:.2f}x" if r["speedup"] else "-", _fit_agreement(r)])
    print(table(f"the paper's Table 1 predicted by mop plan ({args.gpu.upper()} nodes of 8; tokens/s/GPU; "
                "GiB: MoP's predicted peak)",
                ["model", "nodes", "context", "MoP", "paper MoP", "MoP GiB", "FSDP-best", "paper FSDP-best",
                 "speedup", "fit vs paper"], body))
    print()
    print(table("layouts and what binds them", ["model", "context", "MoP layout", "FSDP-best config", "binding"],
                [[r["model"], tokens(r["context"]), r["mop"].get("description", "-"),
                  r["fsdp2_best"].get("description", "-"), _binding(r)] for r in results["rows"]]))
    path = write_json(args.out, "plan", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
