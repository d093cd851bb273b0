"""`mop plan MODEL --nodes N --gpus-per-node G --gpu {h100,h200} --context TOKENS [--finetune lora] [--json]`.

Will a model fit on a cluster at a context, with which MoP layout, and how fast; and the same for
the best FSDP2 configuration (the paper's FSDP-best). MODEL is a preset name (`configs/<name>.toml`),
a TOML config (its `[model]` section) or a Hugging Face config.json (or its directory).

`--dpo` plans DPO: each sequence holds preference pairs packed with their prompt once (a 128K
context is a 128K-token sequence, e.g. one pair of a 126K prompt and two 1K responses); with LoRA
the step also runs the base's forward for the reference, full fine-tuning precomputes it once
(`mop.cost.speed`).

`--finetune lora` plans LoRA over the frozen base (`--lora-rank`, `--lora-targets`, `--base-format`):
the base kept as MODEL is published (`--base-format auto`: a config.json's `quantization_config`,
a preset's `[lora] base_format`), gradients and optimizer state for the adapters alone.

The command is thin: the cost model is the library `mop.cost`, which `mop train`'s fit
(`mop.settle.fit`) uses too: `mop.cost.memory` (per-rank device memory by the paper's Table 3 rows
and host memory per node, from the trainer's own shape, dtype and option rules), `mop.cost.speed`
(the roofline step time), `mop.cost.candidates` (a layout scored, the pick), `mop.cost.cluster` (node
presets). Here: the candidate layouts of a cluster (`mop.plan.search`) and the tables and JSON
(`mop.plan.report`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from mop.config import ConfigError, load_config, load_model_config
from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_SIZE = re.compile(r"^(\d+)([KkMm]?)$")


def presets() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.toml"))


def load_model(spec: str) -> ModelConfig:
    """A preset name, a TOML config or a Hugging Face config.json (or its directory)."""
    path = Path(spec)
    if path.suffix == ".toml" or (not path.exists() and (CONFIGS / f"{spec}.toml").is_file()):
        return load_model_config(path if path.suffix == ".toml" else CONFIGS / f"{spec}.toml")
    if path.is_dir() or path.suffix == ".json":
        from mop.models.hf import config_from_hf

        return config_from_hf(path)
    raise ConfigError("MODEL", f"{spec!r} is no preset, TOML config or config.json; presets: {', '.join(presets())}")


def parse_tokens(text: str, option: str = "--context") -> int:
    """'131072', '128K' or '1M' (K = 1024 tokens)."""
    match = _SIZE.match(text.strip())
    if not match or int(match.group(1)) < 1:
        raise ConfigError(option, f"{text!r} is not a token count; write e.g. 131072, 128K or 1M")
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]


def parse_token_list(text: str, option: str) -> list[int]:
    """'64K,128K,1M': comma-separated token counts (`parse_tokens`), for `option`."""
    return [parse_tokens(part, option) for part in text.split(",")]


def document_tokens(text: str) -> int:
    """`--document-tokens`: the packed documents' length, 0 for one document per sequence."""
    return 0 if text == "0" else parse_tokens(text, "--document-tokens")


def published_format(spec: str) -> str:
    """How MODEL's weights are published, as a `lora.base_format` value: a config.json's
    `quantization_config`, a TOML's `[lora] base_format` ("none" when it sets none)."""
    from mop.models.hf import read_hf_config
    from mop.models.hf_mapping import HFConversionError
    from mop.models.hf_quantized import reader_for
    from mop.models.lora import format_name

    path = Path(spec)
    if path.suffix == ".toml" or (not path.exists() and (CONFIGS / f"{spec}.toml").is_file()):
        fmt = load_config(path if path.suffix == ".toml" else CONFIGS / f"{spec}.toml").lora.base_format
        return "none" if fmt == "auto" else fmt
    try:
        hf = read_hf_config(path if path.is_dir() else path.parent)
        return format_name(reader_for(hf.get("quantization_config"), path).format)
    except HFConversionError as err:
        raise ConfigError("MODEL", str(err)) from None


def adapters(args) -> LoraConfig | None:
    """The LoRA settings `--finetune lora` plans with (None: full fine-tuning)."""
    if args.finetune == "full":
        return None
    base_format = published_format(args.model) if args.base_format == "auto" else args.base_format
    lora = LoraConfig(rank=args.lora_rank, targets=args.lora_targets, base_format=base_format)
    for key, message in lora.validate():
        raise ConfigError(f"--{'lora-' + key if key != 'base_format' else 'base-format'}", message)
    return lora


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=f"a preset ({', '.join(presets())}), a TOML config or a "
                                                       "Hugging Face config.json")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h200", help="node preset: h100 or h200 (8 SXM GPUs, NVLink, 400G per GPU)")
    parser.add_argument("--context", help="tokens per sequence: 131072, 128K, 1M")
    parser.add_argument("--contexts", help="several contexts side by side (the paper's Table 1), e.g. 64K,128K,1M")
    parser.add_argument("--global-batch", type=int, default=0,
                        help="sequences per step (default: each layout's smallest, one per data group)")
    parser.add_argument("--document-tokens", default="0",
                        help="length of the packed documents, for the attention FLOPs (default: the context)")
    parser.add_argument("--routing-skew", type=float, default=1.0,
                        help="busiest expert rank's load / mean under plain EP (LLEP caps it at llep_alpha)")
    parser.add_argument("--device-gib", type=float, help="memory per GPU (default: the preset's)")
    parser.add_argument("--reserve-gib", type=float, help="device memory left out of the plan (default 6)")
    parser.add_argument("--host-gib", type=float, help="host memory per node (default 2048)")
    parser.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU and direction, as reached")
    parser.add_argument("--network-gbps", type=float, help="network GB/s per GPU and direction, as reached")
    parser.add_argument("--host-link-gbps", type=float, help="GPU-host GB/s per direction, as reached")
    parser.add_argument("--peak-tflops", type=float, help="bf16 dense peak TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, help="share of the peak the model FLOPs run at (default 0.4)")
    parser.add_argument("--finetune", choices=("full", "lora"), default="full",
                        help="full fine-tuning, or LoRA adapters over the frozen base")
    parser.add_argument("--lora-rank", type=int, default=LoraConfig.rank, help="LoRA's rank r")
    parser.add_argument("--lora-targets", default=LoraConfig.targets, help="modules with adapters (lora.targets)")
    parser.add_argument("--base-format", default="auto",
                        help="LoRA's frozen base: auto (as MODEL is published), none, fp8, fp8:RxC, mxfp4")
    parser.add_argument("--dpo", action="store_true", help="DPO on preference pairs (the prompt once per pair); the "
                        "reference: LoRA's base in every step, else precomputed")
    parser.add_argument("--grpo", action="store_true", help="GRPO on packed recorded rollouts, their routes replayed")
    parser.add_argument("--rl-beta", type=float, default=0.0, help="with --grpo: the KL to the reference (rl.beta; "
                        "LoRA only: the base's forward in every step)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args) -> dict:
    from mop.cost.cluster import make_cluster
    from mop.plan.report import plan_json
    from mop.plan.search import OBJECTIVES, plan

    if bool(args.context) == bool(args.contexts):
        raise ConfigError("--context", "give one context (--context 128K) or a list (--contexts 64K,128K,1M)")
    contexts = ([parse_tokens(args.context)] if args.context else
                parse_token_list(args.contexts, "--contexts"))
    if args.global_batch < 0:
        raise ConfigError("--global-batch", f"must be >= 0 (0: each layout's smallest), got {args.global_batch}")
    if not args.routing_skew >= 1:
        raise ConfigError("--routing-skew", f"must be >= 1 (1: balanced), got {args.routing_skew}")
    if args.dpo and args.grpo:
        raise ConfigError("--grpo", "plans one objective: give --dpo or --grpo")
    objective = "dpo" if args.dpo else "grpo" if args.grpo else "sft"
    settings = OBJECTIVES[objective] | ({"rl": {"beta": args.rl_beta}} if args.grpo and args.rl_beta else {})
    documents = document_tokens(args.document_tokens)
    model, lora = load_model(args.model), adapters(args)
    cluster = make_cluster(args.gpu, args.nodes, args.gpus_per_node, device_gib=args.device_gib,
                           reserve_gib=args.reserve_gib, host_gib=args.host_gib, nvlink_gbps=args.nvlink_gbps,
                           network_gbps=args.network_gbps, host_link_gbps=args.host_link_gbps,
                           peak_tflops=args.peak_tflops, mfu=args.mfu)
    plans = [plan_json(context, plan(model, cluster, context, args.global_batch, args.routing_skew, documents, lora,
                                     settings)) for context in contexts]
    return {"model": {"name": args.model, **vars(model)}, "cluster": vars(cluster) | {"world": cluster.world},
            "finetune": "full" if lora is None else vars(lora), "objective": objective, "rl_beta": args.rl_beta,
            "assumptions": {"routing_skew": args.routing_skew, "document_tokens": documents or "context",
                            "global_batch": args.global_batch or "one sequence per data group"},
            "plans": plans}


def show(args, results: dict) -> None:
    from mop.plan.report import print_report

    print_report(results, as_json=args.json)
