"""`mop convert`: between mop checkpoints and Hugging Face model directories.

- `to-hf CHECKPOINT OUT`: the checkpoint's weights (saved by any layout) as a `qwen3_moe` or
  `mixtral` directory that transformers loads (`mop.models.hf.save_hf`).
- `from-hf HF_DIR CHECKPOINT`: a HF directory as a step-0 mop checkpoint (the optimizer starts
  fresh), plus `model.toml`, the matching [model] section. Fine-tune with
  `mop train CHECKPOINT/model.toml --checkpoint.resume=CHECKPOINT [...]`. The import checks the
  directory (every tensor config.json implies, of the shape it implies) and copies no weights:
  when the run loads it, each rank reads only its own shards' rows from the safetensors files,
  so HF_DIR must stay where it is.
`to-hf` runs in one process and holds the whole model in host memory.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from mop import checkpoint
from mop.config import Config, ConfigError
from mop.models.config import ModelConfig
from mop.models.hf import HFWeights, empty_model, save_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_hf = directions.add_parser("to-hf", help="export a mop checkpoint as a Hugging Face model directory")
    to_hf.add_argument("checkpoint", type=Path, help="a step_<N> checkpoint directory")
    to_hf.add_argument("out", type=Path, help="the Hugging Face directory to write")
    to_hf.add_argument("--model-type", choices=["qwen3_moe", "mixtral"], default=None,
                       help="architecture to write (default: the one the model's settings express)")
    to_hf.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the written weights")
    from_hf = directions.add_parser("from-hf", help="import a Hugging Face model directory as a mop checkpoint")
    from_hf.add_argument("hf_dir", type=Path, help="a qwen3_moe or mixtral directory (config.json + safetensors)")
    from_hf.add_argument("checkpoint", type=Path, help="the checkpoint directory to create")


def run(args) -> None:
    if args.direction == "to-hf":
        export(args.checkpoint, args.out, args.model_type, DTYPES[args.dtype])
    else:
        import_hf(args.hf_dir, args.checkpoint)


def export(path: Path, out: Path, model_type: str | None, dtype: torch.dtype) -> None:
    if not (path / checkpoint.META).is_file():
        raise ConfigError(str(path), f"is not a complete mop checkpoint (no {checkpoint.META}); pass a step_<N> directory")
    make_directory(out, out)
    model = empty_model(ModelConfig(**checkpoint.read_meta(path)["config"]["model"]), torch.float32)
    checkpoint.load(path, model, None, None, checkpoint.GlobalViews(model, None), with_optimizer=False)
    save_hf(model, out, dtype=dtype, model_type=model_type)
    print(f"mop: wrote {out} from {path}")


def import_hf(hf_dir: Path, path: Path) -> None:
    if path.exists():
        raise ConfigError(str(path), "already exists; choose a new checkpoint directory")
    with HFWeights(hf_dir) as weights:  # checks keys and shapes; reads no tensor data
        cfg, fingerprint = weights.cfg, weights.fingerprint()
    make_directory(path.parent, path)
    checkpoint.save_hf_import(path, hf_dir, fingerprint, Config(model=cfg))
    (path / "model.toml").write_text(model_toml(cfg))
    print(f"mop: wrote {path}; fine-tune with: mop train {path / 'model.toml'} --checkpoint.resume={path}")


def make_directory(directory: Path, named: Path) -> None:
    """Create `directory` (and its parents); if that fails, one line naming `named`, the path asked for."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(str(named), f"cannot be created ({err.strerror or err}: {err.filename}); "
                          "choose a directory this user can create and write") from None


def model_toml(cfg: ModelConfig) -> str:
    """The [model] section of a config file that builds `cfg` (JSON scalars are valid TOML values)."""
    lines = ["[model]"] + [f"{key} = {json.dumps(value)}" for key, value in asdict(cfg).items()]
    return "\n".join(lines) + "\n"
