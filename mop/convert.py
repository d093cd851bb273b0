"""`mop convert`: between mop checkpoints and Hugging Face model directories.

- `to-hf CHECKPOINT OUT`: the checkpoint's weights (saved by any layout) as a directory of its family
  (or of another that expresses it exactly, `--model-type`) that transformers loads
  (`mop.models.hf.write_hf`, file by file), with the tokenizer the
  checkpoint was trained with (a copy of its `tokenizer/`: the HF files of the tokenizer, for the
  byte tokenizer its exact HF equivalent), `generation_config.json` (its bos/eos/pad ids) and
  `eos_token_id`/`bos_token_id` in config.json. No `pad_token_id` goes into config.json:
  transformers would freeze that embedding row in a fine-tune, and mop's pad is often eos itself.
  The weights are written in the dtype the run trained in (`train.dtype` in the checkpoint's
  config; float32 for an import that was never trained: lossless) unless `--dtype` says otherwise;
  `--dtype=published` writes each tensor as the Hugging Face checkpoint the weights came from
  publishes it (the checkpoint's `hf_source`, checked unchanged by its fingerprint: re-quantized to
  its format, fp8 blocks or MXFP4 experts, the other tensors in its dtypes, the MTP layers' stored
  bytes and scales), what an engine serving that checkpoint loads. config.json keeps every key of
  that checkpoint's config.json that mop does not write itself (engines read keys transformers
  ignores: DeepSeek-V3's `topk_method` and `scoring_func` build vLLM's router).
  Multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's): mop trains the main model only and keeps
  them frozen, so the checkpoint records where they are (`mtp` in mop.json, from the import) and
  `to-hf` copies them from there, dequantized and cast like the rest, with the original
  `num_nextn_predict_layers` (`mop.models.hf.MtpLayers`); `--mtp=drop` writes none
  (`num_nextn_predict_layers = 0`), which is also what it writes for a model without them.
- `from-hf HF_DIR CHECKPOINT`: a HF directory as a step-0 mop checkpoint (the optimizer starts
  fresh) with a copy of its tokenizer, plus `model.toml`: the matching [model] section and a
  [data] section naming that copy as `data.tokenizer`, so that
  `mop train CHECKPOINT/model.toml --checkpoint.resume=CHECKPOINT [...]` fine-tunes it on the ids
  it was trained with. A directory without tokenizer.json needs `--tokenizer` (another
  tokenizer.json, or `byte` for a model mop trained with its byte tokenizer). The import checks
  the directory (every tensor config.json implies, of the shape it implies) and copies no
  weights: when the run loads it, each rank reads only its own shards' rows from the
  safetensors files, so HF_DIR must stay where it is.
- `to-peft CHECKPOINT OUT`: a LoRA checkpoint's adapters in PEFT's layout (`mop.models.peft`):
  `adapter_config.json` and `adapter_model.safetensors` that `PeftModel.from_pretrained` loads onto
  the base's transformers model; and in `OUT/serve/` the same adapters in the layout the serving
  engines load (`mop.models.served_adapters`: per-expert adapters where the hub publishes experts
  one by one, vLLM's fused form for gpt-oss), with a warning for an adapter an engine is known to
  drop. Every LoRA checkpoint also holds both, in `peft/`, written when it is saved.
- `merge CHECKPOINT OUT`: the base with the adapters merged in (`W + alpha/r B A`, in fp32) as a
  Hugging Face directory, written file by file like `to-hf`: in bf16 or fp32 (`--dtype`), or
  `--dtype=published`, each tensor as the base publishes it (re-quantized to its format, fp8
  blocks or MXFP4 experts, under its own tensor names; the others in its dtypes). The base is
  the one the checkpoint trained on (`lora_base`): its directory, checked by fingerprint, or
  `--base` for a copy of it elsewhere (a base of another fingerprint is refused), or its run's
  initial weights. A base with multi-token-prediction layers gets them back as it publishes them
  (`--dtype=published`: their stored bytes and scales) or cast like the rest, unless `--mtp=drop`.
`to-hf` and `merge` run in one process and hold one output file's tensors (and the whole
parameters spanning it) at a time, never the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mop import checkpoint
from mop.adapters import describe_base
from mop.config import Config, ConfigError, DataConfig
from mop.data.tokenizer import COMPANION_FILES, AnyTokenizer, load_tokenizer
from mop.models.config import ModelConfig
from mop.models.families import FAMILIES
from mop.models.hf import (
    MAX_SHARD_BYTES,
    AsPublished,
    HFConversionError,
    HFWeights,
    MtpLayers,
    model_types,
    open_recorded,
    open_source,
    source_record,
    write_hf,
)
from mop.models.lora import LoraConfig, adapted_weights
from mop.models.lora import merged as lora_merged
from mop.models.served_adapters import SERVE, save_adapters, serving_warnings
from mop.models.transformer import MoETransformer
from mop.parallel.materialize import initial_values

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GENERATION_CONFIG = "generation_config.json"
MTP_HELP = ("keep (default): write the frozen multi-token-prediction layers the model was imported with; "
            "drop: write none (num_nextn_predict_layers = 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_hf = directions.add_parser("to-hf", help="export a mop checkpoint as a Hugging Face model directory")
    to_hf.add_argument("checkpoint", type=Path, help="a step_<N> checkpoint directory")
    to_hf.add_argument("out", type=Path, help="the Hugging Face directory to write")
    to_hf.add_argument("--model-type", choices=sorted(FAMILIES), default=None,
                       help="family to write as (default: the checkpoint's model.family)")
    to_hf.add_argument("--dtype", choices=[*sorted(DTYPES), "published"], default=None,
                       help="dtype of the written weights (default: the train.dtype the checkpoint was trained in), or "
                            "'published': each tensor as the checkpoint the weights came from publishes it")
    to_hf.add_argument("--mtp", choices=["keep", "drop"], default="keep", help=MTP_HELP)
    to_peft = directions.add_parser("to-peft", help="export a LoRA checkpoint's adapters in PEFT's layout")
    to_peft.add_argument("checkpoint", type=Path, help="a step_<N> directory of a LoRA run")
    to_peft.add_argument("out", type=Path, help="the adapter directory to write")
    to_peft.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the adapters")
    merge = directions.add_parser("merge", help="merge a LoRA checkpoint's adapters into its base, as a Hugging "
                                  "Face model directory")
    merge.add_argument("checkpoint", type=Path, help="a step_<N> directory of a LoRA run")
    merge.add_argument("out", type=Path, help="the Hugging Face directory to write")
    merge.add_argument("--dtype", choices=[*sorted(DTYPES), "published"], default="bfloat16",
                       help="bfloat16 or float32, or 'published': each tensor as the base publishes it")
    merge.add_argument("--base", type=Path, default=None,
                       help="the base's directory, if it moved (its fingerprint must be the recorded one)")
    merge.add_argument("--mtp", choices=["keep", "drop"], default="keep", help=MTP_HELP)
    from_hf = directions.add_parser("from-hf", help="import a Hugging Face model directory as a mop checkpoint")
    from_hf.add_argument("hf_dir", type=Path, help="a Hugging Face directory (config.json + safetensors) of model_type "
                         f"{', '.join(model_types())}")
    from_hf.add_argument("checkpoint", type=Path, help="the checkpoint directory to create")
    from_hf.add_argument("--tokenizer", default=None,
                         help="the model's tokenizer: a tokenizer.json or its directory, or 'byte' "
                              "(default: HF_DIR's tokenizer.json)")
    from_hf.add_argument("--eos-token", default=None,
                         help="its document separator, when its tokenizer_config.json names none "
                              "(model.toml then sets data.eos_token)")


def run(args) -> None:
    if args.direction == "to-hf":
        export(args.checkpoint, args.out, args.model_type, args.dtype, keep_mtp=args.mtp == "keep")
    elif args.direction == "to-peft":
        export_adapters(args.checkpoint, args.out, DTYPES[args.dtype])
    elif args.direction == "merge":
        merge(args.checkpoint, args.out, args.dtype, args.base, keep_mtp=args.mtp == "keep")
    else:
        import_hf(args.hf_dir, args.checkpoint, args.tokenizer, args.eos_token)


def lora_checkpoint(path: Path) -> tuple[dict, ModelConfig, LoraConfig]:
    """The meta, model and LoRA settings of a LoRA checkpoint, or one line saying it is none."""
    if not (path / checkpoint.META).is_file():
        raise ConfigError(str(path), f"is not a complete mop checkpoint (no {checkpoint.META}); "
                          "pass a step_<N> directory")
    meta = checkpoint.read_meta(path)
    if "lora_base" not in meta:
        raise ConfigError(str(path), "is not a LoRA checkpoint (it holds the whole model: export it with to-hf)")
    return meta, ModelConfig(**meta["config"]["model"]), LoraConfig(**meta["config"]["lora"])


def export_adapters(path: Path, out: Path, dtype: torch.dtype) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter directory `out` (module docstring)."""
    meta, cfg, lora = lora_checkpoint(path)
    make_directory(out, out)
    save_adapters(out, cfg, lora, checkpoint.read_adapters(path, meta, cfg, lora), dtype)
    for warning in serving_warnings(cfg, lora):
        print(f"mop: warning: {warning}", file=sys.stderr)
    print(f"mop: wrote {out} (PEFT's layout) and {out / SERVE} (the serving engines') from {path}")


def merge(path: Path, out: Path, dtype: str, base_dir: Path | None, keep_mtp: bool = True) -> None:
    """The checkpoint's base with its adapters merged in, as a HF directory `out` (module docstring)."""
    meta, cfg, lora = lora_checkpoint(path)
    recorded = meta["lora_base"]
    if base_dir is None and recorded["kind"] == "hf":
        base_dir = Path(recorded["path"])
    if dtype == "published" and base_dir is None:
        raise ConfigError("--dtype", f"{path}'s base is its run's initial weights, which have no published format; "
                          "pass --dtype=bfloat16 or float32")
    with torch.device("meta"):
        adapted = MoETransformer(cfg, lora)
        plain = MoETransformer(cfg)
    updates, adapters = adapted_weights(adapted), checkpoint.read_adapters(path, meta, cfg, lora)
    shapes = {name: tensor.shape for name, tensor in plain.state_dict().items()}
    buffers = set(checkpoint.named_buffers(plain))
    with (HFWeights(base_dir) if base_dir is not None else nullcontext()) as base:
        if base is not None and (recorded["kind"] != "hf" or base.fingerprint() != recorded["fingerprint"]):
            raise ConfigError("--base", f"{base_dir} is not the base {path} trained on ({describe_base(recorded)}); "
                              "merge onto that one")
        rows = base.rows if base is not None else initial_values(recorded["seed"], recorded["init_std"])
        saved_buffers = checkpoint.read_tensors(path, meta, {n: shapes[n] for n in buffers}, buffers) if buffers else {}

        def read(names: list[str]) -> dict[str, torch.Tensor]:  # one output file's tensors at a time
            tensors = {}
            for name in names:
                if name in saved_buffers:
                    tensors[name] = saved_buffers[name]
                    continue
                weight = rows(name, shapes[name], 0, shapes[name][0])
                update = updates.get(name)
                tensors[name] = weight if update is None else lora_merged(
                    weight, adapters[update.lora_a], adapters[update.lora_b], lora.scaling, update.transposed)
            return tensors

        make_directory(out, out)
        token_ids = export_tokenizer(path, meta, out)
        published = AsPublished(base) if dtype == "published" else None
        mtp = MtpLayers(base) if keep_mtp and base is not None and base.mtp else None
        write_hf(cfg, out, read, DTYPES.get(dtype, torch.bfloat16), None, MAX_SHARD_BYTES, token_ids, published, mtp,
                 base.hf_config if base is not None else None)
    print(f"mop: wrote {out}: the base with the adapters of {path} merged in")


def export(path: Path, out: Path, model_type: str | None, dtype: str | None,
           max_shard_bytes: int = MAX_SHARD_BYTES, keep_mtp: bool = True) -> None:
    """Checkpoint `path` as a HF folder `out`, written file by file: only one output file's tensors are read
    from the checkpoint at a time (`write_hf`), so no process holds the whole model."""
    if not (path / checkpoint.META).is_file():
        raise ConfigError(str(path), f"is not a complete mop checkpoint (no {checkpoint.META}); "
                          "pass a step_<N> directory")
    meta = checkpoint.read_meta(path)
    cfg = ModelConfig(**meta["config"]["model"])
    with torch.device("meta"):
        model = MoETransformer(cfg)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    buffers = set(checkpoint.named_buffers(model))

    def read(names: list[str]) -> dict[str, torch.Tensor]:  # one output file's tensors at a time
        return checkpoint.read_tensors(path, meta, {name: shapes[name] for name in names}, buffers)

    source = meta.get("hf_source")
    if dtype == "published" and source is None:
        raise ConfigError("--dtype", f"{path}'s weights did not come from a Hugging Face checkpoint (mop convert "
                          "from-hf), so they have no published format; pass --dtype=bfloat16 or float32")
    make_directory(out, out)
    token_ids = export_tokenizer(path, meta, out)
    record = meta.get("mtp") if keep_mtp else None
    written = cfg if keep_mtp else replace(cfg, mtp_loss_coef=0.0)  # --mtp=drop: a trained model's depths too
    with (mtp_source(record, path) if record else nullcontext()) as layers, \
            (open_source(source, "--dtype") if dtype == "published" else nullcontext()) as base:
        write_hf(written, out, read, DTYPES.get(dtype or meta["config"]["train"]["dtype"], torch.bfloat16), model_type,
                 max_shard_bytes, token_ids, AsPublished(base) if base is not None else None,
                 MtpLayers(layers) if layers is not None else None, source and source["config"])
    print(f"mop: wrote {out} from {path}" + (f" with the {record['layers']} multi-token-prediction layer(s) of "
                                             f"{record['path']}" if record else ""))


def mtp_source(record: dict, path: Path) -> HFWeights:
    """The Hugging Face directory a checkpoint's frozen multi-token-prediction layers are read from,
    opened, checked unchanged (its `mtp` record's fingerprint)."""
    weights, problem = open_recorded(record, mtp=True)
    if weights is None:
        raise ConfigError("--mtp", f"{path} keeps its multi-token-prediction layers in {Path(record['path'])}, which "
                          f"{problem}; restore that directory, or pass --mtp=drop to write the model without them")
    return weights


def export_tokenizer(path: Path, meta: dict, out: Path) -> dict[str, int]:
    """Copy the checkpoint's tokenizer files into `out` and write generation_config.json; returns
    the ids config.json carries. A checkpoint saved before mop recorded tokenizers gets a note."""
    for name in ("tokenizer.json", *COMPANION_FILES, GENERATION_CONFIG):  # an earlier export's, into the same `out`
        (out / name).unlink(missing_ok=True)
    record = meta.get("tokenizer")
    if record is None:
        print(f"mop: note: {path} does not record its tokenizer (saved by an older mop); "
              f"wrote no tokenizer files, {GENERATION_CONFIG} or token ids")
        return {}
    copy = path / checkpoint.TOKENIZER
    if not copy.is_dir():
        raise ConfigError(str(path), f"has no {checkpoint.TOKENIZER}/ although {checkpoint.META} records a tokenizer; "
                          "the checkpoint is incomplete: export another step_<N>")
    for file in copy.iterdir():
        shutil.copyfile(file, out / file.name)
    ids = {f"{kind}_token_id": record[f"{kind}_id"] for kind in ("bos", "eos", "pad")
           if record[f"{kind}_id"] is not None}
    (out / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
    return {key: value for key, value in ids.items() if key != "pad_token_id"}


def import_hf(hf_dir: Path, path: Path, tokenizer_spec: str | None, eos_token: str | None) -> None:
    if path.exists():
        raise ConfigError(str(path), "already exists; choose a new checkpoint directory")
    with HFWeights(hf_dir) as weights:  # checks keys and shapes; reads no tensor data
        cfg, source = weights.cfg, source_record(weights)
        mtp = {"path": str(hf_dir.resolve()), "fingerprint": weights.fingerprint(mtp=True),
               "layers": MtpLayers(weights).layers, "tensors": len(weights.mtp)} if weights.mtp else None
    if mtp:
        print(f"mop: the {mtp['layers']} multi-token-prediction layer(s) of {hf_dir} ({mtp['tensors']} tensors) stay "
              "frozen outside the model mop trains; mop convert to-hf writes them back")
    tokenizer = import_tokenizer(hf_dir, tokenizer_spec, eos_token, cfg.vocab_size)
    own = "byte" if tokenizer.kind == "byte" else str(path.resolve() / checkpoint.TOKENIZER)
    config = Config(model=cfg, data=DataConfig(tokenizer=own, eos_token=eos_token or ""))
    make_directory(path.parent, path)
    checkpoint.save_hf_import(path, source, config, tokenizer, mtp)
    (path / "model.toml").write_text(config_toml(config))
    print(f"mop: wrote {path} (tokenizer {tokenizer.name}); fine-tune with: "
          f"mop train {path / 'model.toml'} --checkpoint.resume={path}")


def import_tokenizer(hf_dir: Path, spec: str | None, eos_token: str | None, vocab_size: int) -> AnyTokenizer:
    """The tokenizer an import trains with: `spec` (--tokenizer), else HF_DIR's tokenizer.json;
    its ids must fit the model's vocabulary."""
    if spec is None:
        if not (hf_dir / "tokenizer.json").is_file() and (hf_dir / "tiktoken.model").is_file():
            raise HFConversionError(
                f"{hf_dir}: its tokenizer is tiktoken (tiktoken.model, as Kimi-K2's); convert it once to tokenizer.json "
                "with transformers: AutoTokenizer.from_pretrained(DIR, trust_remote_code=True).save_pretrained(OUT) "
                "(needs tiktoken and blobfile), then pass --tokenizer OUT/tokenizer.json")
        if not (hf_dir / "tokenizer.json").is_file():
            raise HFConversionError(f"{hf_dir}: no tokenizer.json, so the tokens its ids stand for are unknown; pass "
                                    "--tokenizer PATH (the model's tokenizer.json or its directory), or "
                                    "--tokenizer=byte for a model trained with mop's byte tokenizer")
        spec = str(hf_dir)
    tokenizer = load_tokenizer(spec, eos_token)
    if tokenizer.vocab_size > vocab_size:
        raise HFConversionError(f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but "
                                f"{hf_dir}/config.json has vocab_size={vocab_size}: it is not this model's; "
                                "pass the model's own with --tokenizer")
    return tokenizer


def config_toml(config: Config) -> str:
    """model.toml: the [model] section (and its family's [model.options]) that builds the imported model
    and the [data] settings that name its tokenizer (JSON scalars are valid TOML values)."""
    data = {"tokenizer": config.data.tokenizer}
    if config.data.eos_token:
        data["eos_token"] = config.data.eos_token
    model = asdict(config.model)
    options = model.pop("options")
    sections = {"model": model, **({"model.options": options} if options is not None else {}), "data": data}
    return "\n".join(f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())
                     for name, values in sections.items())


def make_directory(directory: Path, named: Path) -> None:
    """Create `directory` (and its parents); if that fails, one line naming `named`, the path asked for."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(str(named), f"cannot be created ({err.strerror or err}: {err.filename}); "
                          "choose a directory this user can create and write") from None
