"""`mop plan`'s output: a table per context (or the paper's Table 1 shape for several), or JSON."""

from __future__ import annotations

import json

from mop.cost.activations import ROWS
from mop.cost.candidates import Candidate, Choice, describe
from mop.cost.cluster import GIB


def layout(c: Candidate) -> dict:
    """The degrees and options of a candidate, as the keys `mop train` takes (fsdp2: Table 2's axes)."""
    p, t, o = c.config.parallel, c.config.train, c.config.optim
    if p.strategy == "fsdp2":
        return {"fsdp": c.cluster.world // (p.sequence * c.tp), "ep": p.expert, "cp": p.sequence, "tp": c.tp,
                "cpu_offload": p.fsdp_cpu_offload, "activation_checkpointing": t.activation_checkpointing,
                "micro_batch": t.micro_batch}
    return {"sequence": p.sequence, "expert": p.expert, "vocab": p.vocab, "attention_head_chunks": p.attention_head_chunks,
            "llep_chunks": p.llep_chunks, "activation_checkpointing": t.activation_checkpointing,
            "offload_activations": t.offload_activations, "host_optimizer": o.offload,
            "speculative": o.speculative, "micro_batch": t.micro_batch, "global_batch": t.global_batch}


def train_settings(c: Candidate) -> list[str]:
    """The `mop train` overrides that run this layout with the model's config: what `mop train`
    launches on one node (parallel.nproc ranks), what torchrun runs on several (nproc is then ignored)."""
    p, t, o = c.config.parallel, c.config.train, c.config.optim
    settings = [f"--parallel.strategy={p.strategy}", f"--parallel.nproc={p.nproc}", f"--parallel.sequence={p.sequence}", f"--parallel.expert={p.expert}",
                f"--parallel.vocab={p.vocab}", f"--parallel.vocab_logits={p.vocab_logits}",
                f"--parallel.expert_balance={p.expert_balance}",
                f"--parallel.attention_head_chunks={p.attention_head_chunks}", f"--parallel.llep_chunks={p.llep_chunks}",
                f"--train.activation_checkpointing={t.activation_checkpointing}",
                f"--train.offload_activations={str(t.offload_activations).lower()}", f"--train.dtype={t.dtype}",
                f"--train.micro_batch={t.micro_batch}", f"--train.global_batch={t.global_batch}",
                f"--data.seq_len={c.config.data.seq_len}", f"--optim.offload={str(o.offload).lower()}"]
    if o.offload:
        settings.append(f"--optim.speculative={str(o.speculative).lower()}")
    lora = c.config.adapters
    if lora is not None:
        settings += ["--train.finetune=lora", f"--lora.rank={lora.rank}", f"--lora.targets={lora.targets}",
                     f"--lora.base_format={lora.base_format}"]
    if p.strategy == "fsdp2":
        settings.append(f"--parallel.fsdp_cpu_offload={str(p.fsdp_cpu_offload).lower()}")
    return settings


def choice_json(choice: Choice, key: str) -> dict:
    """One system's pick; when nothing fits, the closest layout's memory (its speed is left null)."""
    c = choice.closest
    return {"fits": choice.best is not None, "peak_device_bytes": c.memory.peak_device_bytes,
            "budget_device_bytes": c.cluster.budget_bytes, "host_bytes_per_node": c.memory.host_bytes_per_node,
            "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu if choice.best else None,
            "step_seconds": c.time.seconds if choice.best else None, key: layout(c), "description": describe(c),
            "binding": choice.binding, "peak_moment": c.memory.peak.name, "device_rows": c.memory.peak.rows,
            "moments": {m.name: m.total for m in c.memory.moments}, "host_rows_per_rank": c.memory.host_bytes_per_rank,
            "time": c.time.as_dict(), "train_settings": train_settings(c), "considered": choice.considered,
            "tensor_parallel_modelled_only": c.tp > 1}


def plan_json(context: int, choices: dict[str, Choice]) -> dict:
    mop, fsdp2 = choice_json(choices["mop"], "layout"), choice_json(choices["fsdp2_best"], "config")
    speedup = (mop["tokens_per_s_per_gpu"] / fsdp2["tokens_per_s_per_gpu"]
               if mop["tokens_per_s_per_gpu"] and fsdp2["tokens_per_s_per_gpu"] else None)
    return {"context": context, "mop": mop, "fsdp2_best": fsdp2, "speedup": speedup}


def tokens(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def speed_cell(side: dict) -> str:
    """tokens/s/GPU, or OOM when nothing fits."""
    return f"{side['tokens_per_s_per_gpu']:.0f}" if side["fits"] else "OOM"


def detail(results: dict, plan: dict) -> str:
    """One context: both systems' layouts, memory rows, host memory, time and the binding constraint."""
    m, cl = results["model"], results["cluster"]
    lines = [f"mop plan: {m['name']} on {cl['nodes']} x {cl['gpus_per_node']} {cl['gpu'].upper()} "
             f"(device budget {_gib(cl['device_bytes'] - cl['reserve_bytes'])} GiB of {_gib(cl['device_bytes'])}, "
             f"host {_gib(cl['host_bytes'])} GiB per node), context {tokens(plan['context'])}, {_finetune(results)}"]
    sides = [("MoP", plan["mop"]), ("FSDP-best", plan["fsdp2_best"])]
    rows = [("fits", [("yes" if s["fits"] else "NO (closest shown)") for _, s in sides]),
            ("layout", [s["description"] for _, s in sides]),
            ("peak device GiB", [f"{_gib(s['peak_device_bytes'])} ({s['peak_moment'].split(':')[0]}, "
                                 f"{s['peak_device_bytes'] / s['budget_device_bytes']:.0%} of budget)" for _, s in sides])]
    rows += [(f"  {row.replace('_', ' ')}", [_gib(s["device_rows"][row]) for _, s in sides]) for row in ROWS]
    rows += [("host GiB per node", [_gib(s["host_bytes_per_node"]) for _, s in sides]),
             ("step seconds", [f"{s['step_seconds']:.2f}" if s["step_seconds"] else "-" for _, s in sides]),
             ("tokens/s/GPU", [speed_cell(s) for _, s in sides])]
    width = max(len(r[0]) for r in rows) + 2
    col = max(len(v) for _, values in rows for v in values) + 2
    lines.append(" " * width + "".join(name.ljust(col) for name, _ in sides))
    lines += [label.ljust(width) + "".join(v.ljust(col) for v in values) for label, values in rows]
    for name, side in sides:
        lines.append(f"{name} binding constraint: {side['binding']}")
    lines.append("MoP as mop train settings: " + " ".join(plan["mop"]["train_settings"]))
    if plan["fsdp2_best"]["tensor_parallel_modelled_only"]:
        lines.append("FSDP-best uses tensor parallelism, which the planner models and mop train's fsdp2 strategy lacks")
    return "\n".join(lines)


def _finetune(results: dict) -> str:
    lora = results.get("finetune", "full")
    what = "full fine-tuning" if lora == "full" else (
        f"LoRA rank {lora['rank']} on {lora['targets']} over a {lora['base_format']} base")
    if results.get("objective") == "dpo":
        reference = "the base's forward in every step" if lora != "full" else "precomputed once"
        what = f"DPO ({what}; sequences of preference pairs, the prompt once; reference {reference})"
    if results.get("objective") == "grpo":
        kl = f"KL {results['rl_beta']} to the base's forward in every step" if results.get("rl_beta") else "no KL"
        what = f"GRPO ({what}; sequences of packed rollouts, their routes replayed; {kl})"
    return what


def table1(results: dict) -> str:
    """Several contexts side by side: the paper's Table 1 shape."""
    m, cl = results["model"], results["cluster"]
    header = ["context", "MoP tok/s/GPU", "MoP GiB", "MoP layout", "FSDP-best tok/s/GPU", "FSDP-best GiB",
              "FSDP-best config", "speedup"]
    body = [[tokens(p["context"]), speed_cell(p["mop"]), _gib(p["mop"]["peak_device_bytes"]), p["mop"]["description"],
             speed_cell(p["fsdp2_best"]), _gib(p["fsdp2_best"]["peak_device_bytes"]), p["fsdp2_best"]["description"],
             f"{p['speedup']:.2f}x" if p["speedup"] else "-"]
            for p in results["plans"]]
    widths = [max(len(str(r[i])) for r in [header, *body]) + 2 for i in range(len(header))]
    title = (f"mop plan: {m['name']} on {cl['nodes']} x {cl['gpus_per_node']} {cl['gpu'].upper()}, "
             f"{_finetune(results)}, predicted "
             "tokens/s/GPU (OOM: nothing fits; GiB: peak device memory, of the closest layout when OOM)")
    return "\n".join([title, *("".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in [header, *body])])


def print_report(results: dict, as_json: bool) -> None:
    plans = results["plans"]
    if as_json:
        out = {k: v for k, v in results.items() if k != "plans"} | (plans[0] if len(plans) == 1 else {"plans": plans})
        print(json.dumps(out, indent=1, default=str))
    elif len(plans) == 1:
        print(detail(results, plans[0]))
    else:
        print(table1(results))
        for plan in plans:
            print()
            print(detail(results, plan))
