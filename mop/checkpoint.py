"""Training checkpoints: layout-independent, atomic, the newest K kept; `torch.distributed.checkpoint`.

Content of one checkpoint (a directory `step_<N>`, N = optimizer steps completed):
- `model/<name>`: every trained parameter as its *global* tensor under its name in the unwrapped
  model (`canonical_name`), whatever layout trained it: all of them, or a LoRA run's adapters
  (its frozen base is where the run read it from, `lora_base`);
- `optim/<name>/{exp_avg,exp_avg_sq,step}`: the AdamW state in the same global form, from
  `torch.optim.AdamW` or from `HostAdamW` (the two are interchangeable; the fp32 master is the
  parameter itself);
- `rng/cpu`: the CPU generator state;
- `mop.json` (written by rank 0): the step, the data stream's position, the run's config, and
  the tokenizer the run trained with (`mop.data.tokenizer.describe`: kind, fingerprint, vocabulary
  size, eos/bos/pad ids); a LoRA run's `lora_base`, what its base is (`mop.adapters.base_identity`:
  a Hugging Face directory and its fingerprint, or the run's own initial weights), which a resume
  and a merge check; a run's `reference`, what its objective's precomputed reference log-probs were
  computed from (`mop.objectives.reference_table`; DPO's, or the KL's of policy-gradient training),
  which a resume checks against the stored ones; `mtp`, where the frozen multi-token-prediction
  layers of the model it was imported from are (`save_hf_import`), which `mop convert to-hf` copies;
  `hf_source`, the Hugging Face checkpoint the run's weights came from (`mop.models.hf.source_record`:
  its directory, fingerprint and config.json; an import's, carried by every checkpoint of a run from
  it, or a LoRA run's base), whose config.json keys every export keeps and whose format
  `--dtype=published` writes;
- `tokenizer/` (written by rank 0): the Hugging Face files of that tokenizer (`hf_files()`: for the
  byte tokenizer its exact HF equivalent), so that `mop convert to-hf` is self-contained and a
  run can name the checkpoint's own copy as `data.tokenizer`;
- `peft/` (a LoRA run's, written by rank 0 from the saved shards): the adapters in PEFT's layout
  (`mop.models.peft`), which `PeftModel.from_pretrained` loads onto the base, and in `peft/serve/`
  in the layout vLLM and SGLang load (`mop.models.served_adapters`).
A Hugging Face import (`save_hf_import`) is a `mop.json` and a `tokenizer/` alone, naming the HF
directory whose safetensors each rank reads its own rows from when it loads.

Tokenizer. The ids a model was trained on mean the tokens of one vocabulary; resuming with a
tokenizer of another fingerprint (`check_tokenizer`) is an error unless
`checkpoint.allow_tokenizer_change`. A changed document separator (`data.eos_token`) is not a
change of vocabulary and is allowed. Checkpoints saved before mop recorded tokenizers have no
record and no `tokenizer/`; they resume unchecked.

Global views. DCP reshards by global tensor metadata, so each rank presents its local tensors as
DTensors of the global shape, without communication (`mop.parallel.views.GlobalViews`). Loading
builds the same views over the new layout's tensors and lets DCP read what each rank needs into
them in place, so a checkpoint saved with any layout loads into any other.

Host optimizer. With `HostAdamW` (`mop.optim.optimizer.HostOptimizer`) the saved weights are its fp32 masters (the device may hold only
bf16 working copies) and its moments; all are host tensors, presented on CPU meshes, so saving
allocates no device memory for them and loading writes into the host tensors themselves (same
storage, new contents); the working weights are then copied from the loaded masters.

Atomicity. Every rank writes into `step_<N>.partial`; DCP's save returns once the metadata is
written; rank 0 then writes `mop.json` and renames the directory to `step_<N>` (a rename is atomic
on one file system), and only then removes the oldest complete checkpoints beyond `keep`. A crash
at any point leaves every complete checkpoint as it was; `.partial` leftovers are removed by the
next save. Multi-node runs need `checkpoint.dir` on a file system all nodes share.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from mop.config import Config, ConfigError
from mop.data.tokenizer import AnyTokenizer, describe
from mop.models.config import ModelConfig
from mop.models.hf import HFWeights
from mop.models.lora import LoraConfig
from mop.models.served_adapters import save_adapters
from mop.models.transformer import MoETransformer
from mop.optim.optimizer import Optimizer
from mop.parallel.checkpointing import canonical_name
from mop.parallel.materialize import write_weights
from mop.parallel.views import GlobalViews

META = "mop.json"
META_KEYS = {"step", "data", "config", "has_optimizer"}  # what every mop.json holds
DCP_METADATA = ".metadata"  # DCP's index of the shard files, written last by the coordinator
PARTIAL = ".partial"
TOKENIZER = "tokenizer"
PEFT = "peft"


def _state(model, optimizer: Optimizer | None, views: GlobalViews, with_optimizer: bool) -> dict:
    """What DCP saves and loads: every trained weight (the optimizer's master where it keeps one; a
    LoRA run's adapters, not its frozen base) and, with `with_optimizer`, their moments, as global views."""
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = {}
    for p in trained:
        master = optimizer.master(p) if optimizer is not None else None
        weights[views.names[id(p)]] = views.of(p) if master is None else views.of(p, master, host=optimizer.on_host)
    state = {"model": weights, "rng": {"cpu": torch.get_rng_state()}}
    buffers = named_buffers(model)
    if buffers:  # whole on every rank (DCP writes a replicated tensor once); none before glm4_moe's router
        state["buffers"] = buffers
    if with_optimizer:
        state["optim"] = {views.names[id(p)]: _moments(p, optimizer, views) for p in trained}
    return state


def named_buffers(model) -> dict[str, torch.Tensor]:
    """The model's buffers by their name in the unwrapped model."""
    return {canonical_name(name): buffer for name, buffer in model.named_buffers()}


def _moments(param, optimizer: Optimizer, views: GlobalViews) -> dict:
    saved = optimizer.moments(param)
    return {"exp_avg": views.of(param, saved["exp_avg"], host=optimizer.on_host),
            "exp_avg_sq": views.of(param, saved["exp_avg_sq"], host=optimizer.on_host), "step": saved["step"]}


def checkpoint_dir(config: Config, run_dir: Path) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def save(directory: Path, step: int, model, optimizer: Optimizer, views: GlobalViews, data_state: dict,
         config: Config, keep: int, tokenizer: AnyTokenizer, base: dict | None = None,
         reference: dict | None = None, mtp: dict | None = None, hf_source: dict | None = None) -> Path:
    """Write checkpoint `step_<step>` atomically (collective over all ranks) and prune to the newest `keep`;
    `base`: a LoRA run's base, `reference`: what its precomputed reference log-probs were made of, `mtp`:
    where its frozen multi-token-prediction layers are (`save_hf_import`), `hf_source`: the Hugging Face
    checkpoint its weights came from (module docstring).

    A file-system failure (read-only, full, permissions) is one line naming `checkpoint.dir`; the
    complete checkpoints before it are untouched."""
    try:
        return _save(directory, step, model, optimizer, views, data_state, config, keep, tokenizer,
                     {"lora_base": base, "reference": reference, "mtp": mtp, "hf_source": hf_source})
    except (OSError, CheckpointException) as err:  # DCP's own exception is a BaseException
        raise ConfigError("checkpoint.dir", f"{directory} cannot be written ({_last_line(err)}); the checkpoints "
                          f"before step {step} are intact: free space or fix permissions, then resume with "
                          "--checkpoint.resume=latest") from None


def _save(directory: Path, step: int, model, optimizer: Optimizer, views: GlobalViews, data_state: dict,
          config: Config, keep: int, tokenizer: AnyTokenizer, records: dict) -> Path:
    final = directory / f"step_{step}"
    partial = directory / f"step_{step}{PARTIAL}"
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        for leftover in directory.glob(f"step_*{PARTIAL}"):
            shutil.rmtree(leftover)
        partial.mkdir(parents=True)
    _barrier()
    with _quiet_if_single_process():
        dcp.save(_state(model, optimizer, views, with_optimizer=True), checkpoint_id=partial,
                 no_dist=not dist.is_initialized())
    if main:
        meta = {"step": step, "data": data_state, "config": asdict(config), "has_optimizer": True,
                "tokenizer": _write_tokenizer(partial, tokenizer), **{k: v for k, v in records.items() if v}}
        if records["lora_base"]:
            _write_peft(partial, meta, config)
        (partial / META).write_text(json.dumps(meta, indent=1))
        if final.exists():  # a complete checkpoint of this step from an earlier attempt: replace it
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def save_hf_import(path: Path, source: dict, config: Config, tokenizer: AnyTokenizer, mtp: dict | None = None) -> None:
    """A step-0 checkpoint whose weights are those of the Hugging Face directory `source` records
    (`mop.models.hf.source_record`: its path, fingerprint and config.json), read in
    place whenever it is loaded: each rank reads only the rows of its own shards from the
    safetensors files (`mop.models.hf.HFWeights`), so no process ever holds the whole model. No
    weights are copied: the directory must stay where it is, unchanged (its fingerprint is checked at
    load), and the record is every later checkpoint's `hf_source`; the `tokenizer` (small) is, like every
    checkpoint's. `mtp`: where the directory's multi-token-prediction layers are, which mop keeps frozen outside the model it trains (`{"path",
    "fingerprint" (of their files too), "layers"}`), carried by every checkpoint of a run from it
    (`mop.build.TrainingRun.mtp`). One process; atomic like `save`."""
    partial = path.with_name(path.name + PARTIAL)
    partial.mkdir(parents=True)
    meta = {"step": 0, "data": None, "config": asdict(config), "has_optimizer": False,
            "hf_weights": source["path"], "hf_fingerprint": source["fingerprint"], "hf_source": source,
            "tokenizer": _write_tokenizer(partial, tokenizer), **({"mtp": mtp} if mtp else {})}
    (partial / META).write_text(json.dumps(meta, indent=1))
    partial.rename(path)


def _write_peft(directory: Path, meta: dict, config: Config) -> None:
    """A LoRA checkpoint's adapters in PEFT's layout, in `directory/peft` (`mop.models.peft`), and the
    engines' in `directory/peft/serve` (`mop.models.served_adapters`), read
    back from the shards just saved, in the dtype the run computes in."""
    dtype = torch.bfloat16 if config.train.dtype == "bfloat16" else torch.float32
    adapters = read_adapters(directory, meta, config.model, config.adapters)
    save_adapters(directory / PEFT, config.model, config.adapters, adapters, dtype)


def read_adapters(path: Path, meta: dict, cfg: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Every adapter of a LoRA checkpoint, whole, in fp32, in one process."""
    with torch.device("meta"):
        model = MoETransformer(cfg, lora)
    shapes = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    return read_tensors(path, meta, shapes, set())


def _write_tokenizer(directory: Path, tokenizer: AnyTokenizer) -> dict:
    """Write the tokenizer's Hugging Face files into `directory/tokenizer`; returns its record."""
    (directory / TOKENIZER).mkdir()
    for name, content in tokenizer.hf_files().items():
        (directory / TOKENIZER / name).write_bytes(content)
    return describe(tokenizer)


@contextmanager
def _quiet_if_single_process(alone: bool = False):
    """DCP warns on every single-process save/load that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if alone or not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def resolve_resume(config: Config, run_dir: Path | None) -> Path | None:
    """The checkpoint to resume from (`checkpoint.resume`), or None to start fresh."""
    choice = config.checkpoint.resume
    if not choice:
        return None
    if choice == "latest":
        found = complete_checkpoints(checkpoint_dir(config, run_dir)) if run_dir is not None else []
        return found[-1] if found else None
    path = Path(choice)
    if not (path / META).is_file():
        raise ConfigError("checkpoint.resume", f"{path} is not a complete mop checkpoint (no {META}); "
                          "pass a step_<N> directory, 'latest', or '' to start fresh")
    return path


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise damaged(path, err) from None
    missing = _missing_meta(meta)
    if missing:
        raise damaged(path, ValueError(f"{META} lacks {', '.join(missing)}"))
    return meta


def _missing_meta(meta) -> list[str]:
    """The entries every `mop.json` holds that `meta` lacks."""
    if not isinstance(meta, dict):
        return sorted(META_KEYS)
    config = meta.get("config")
    has_model = isinstance(config, dict) and isinstance(config.get("model"), dict)
    return sorted(META_KEYS - meta.keys()) + ([] if has_model else ["config.model"])


def damaged(path: Path, err: BaseException) -> ConfigError:
    """The one-line error for a checkpoint that cannot be read (corrupt, truncated, files missing)."""
    return ConfigError("checkpoint.resume", f"{path} cannot be read ({_last_line(err)}); it is damaged or "
                       "incomplete: resume an earlier step_<N> of the same run, or start fresh")


def _last_line(err: BaseException) -> str:
    """The gist of an I/O or DCP error for a one-line message: its last line, at most 200 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]


IMPORT_LOSS_WEIGHTS = ("aux_loss_coef", "z_loss_coef", "mtp_loss_coef")
"""What a fine-tune of a Hugging Face import may set for itself: its config.json's loss weights are defaults,
not a choice (with `mtp_loss_coef` > 0 the import's MTP layers are read as the model's)."""


def check_compatible(meta: dict, config: Config, path: Path) -> None:
    """The checkpoint's model must be the configured one (the layout may differ; a Hugging Face
    import's loss weights too, `IMPORT_LOSS_WEIGHTS`)."""
    # Checkpoints written before model families carry no family: their modules are qwen3_moe's; a field
    # added since (model.mtp_layers, ...) has its default in them.
    saved = {**asdict(ModelConfig(family="qwen3_moe")), **meta["config"]["model"]}
    for key, value in asdict(config.model).items():
        if meta.get("hf_weights") and key in IMPORT_LOSS_WEIGHTS:
            continue
        if saved.get(key) != value:
            raise ConfigError(f"model.{key}", f"checkpoint {path} was saved with model.{key}={saved.get(key)!r}, "
                              f"this run has {value!r}; use the checkpoint's model settings")


def check_tokenizer(meta: dict, tokenizer: AnyTokenizer, config: Config, path: Path) -> None:
    """The run's tokenizer must be the checkpoint's (same kind and fingerprint: every id means the
    same token), unless `checkpoint.allow_tokenizer_change`; a checkpoint without a record (saved
    before mop kept one) is not checked."""
    saved = meta.get("tokenizer")
    if saved is None or config.checkpoint.allow_tokenizer_change:
        return
    if (saved["kind"], saved["fingerprint"]) != (tokenizer.kind, tokenizer.fingerprint):
        own = "byte" if saved["kind"] == "byte" else path / TOKENIZER
        raise ConfigError("data.tokenizer", f"checkpoint {path} was trained with the tokenizer {_label(saved)}, "
                          f"this run has {_label(describe(tokenizer))}; set --data.tokenizer={own} (the checkpoint's "
                          "own), or --checkpoint.allow_tokenizer_change=true to train it with another vocabulary")


def _label(record: dict) -> str:
    return "byte" if record["kind"] == "byte" else f"{record['name']} (sha256 {record['fingerprint'][:12]})"


def load(path: Path, model, optimizer: Optimizer | None, views: GlobalViews, with_optimizer: bool = True,
         meta: dict | None = None) -> dict:
    """Load checkpoint `path` into the model (and the optimizer, if asked and the checkpoint has its
    state) in place; returns its meta (`meta`: the one the caller has read already). Without an
    optimizer (`mop convert`), the weights only."""
    meta = meta or read_meta(path)
    if meta.get("hf_weights"):
        _load_hf_weights(path, meta, model, optimizer, views)
        return meta
    with_optimizer = with_optimizer and optimizer is not None and meta["has_optimizer"]
    state = _state(model, optimizer, views, with_optimizer=with_optimizer)
    _dcp_load(path, state)
    torch.set_rng_state(state["rng"]["cpu"])
    if optimizer is not None:
        optimizer.weights_written()
    return meta


def read_tensors(path: Path, meta: dict, shapes: dict[str, torch.Size], buffers: set[str]) -> dict[str, torch.Tensor]:
    """Whole fp32 tensors of some of a checkpoint's parameters and buffers (`shapes`: name -> global
    shape; `buffers`: which of them are buffers), in one process: what `mop convert to-hf` reads
    for one output file at a time. DCP reads only the requested tensors; a Hugging Face import's
    are read from its folder."""
    out = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    if meta.get("hf_weights"):
        with HFWeights(Path(meta["hf_weights"])) as weights:
            for name, tensor in out.items():
                tensor.copy_(weights.rows(name, tensor.shape, 0, tensor.shape[0]))
        return out
    state = {"model": {n: t for n, t in out.items() if n not in buffers}}
    if buffers & out.keys():
        state["buffers"] = {n: t for n, t in out.items() if n in buffers}
    _dcp_load(path, state, alone=True)
    return out


def _dcp_load(path: Path, state: dict, alone: bool = False) -> None:
    """DCP reads `state`'s tensors (those it names, no others) from checkpoint `path`, in place;
    with every rank of a run, or `alone` (one rank of it reading for itself, without collectives)."""
    if not (path / DCP_METADATA).is_file():  # else DCP logs two tracebacks of its fallbacks before failing
        raise damaged(path, FileNotFoundError(f"no {DCP_METADATA}, the index of its shards"))
    try:
        with _quiet_if_single_process(alone):
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=alone or not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # DCP's own exception is a BaseException
        raise damaged(path, err) from None


def _load_hf_weights(path: Path, meta: dict, model, optimizer: Optimizer | None, views: GlobalViews) -> None:
    """A Hugging Face import's weights (see `save_hf_import`): each rank reads its own rows, into
    the host masters when there is a host optimizer (then copied to the working weights)."""
    source = Path(meta["hf_weights"])
    if not source.is_dir():
        raise ConfigError("checkpoint.resume", f"{path} imports the weights of {source}, which is not a directory "
                          "any more; restore it or import again with mop convert from-hf")
    with HFWeights(source) as imported:  # as imported (config.json's model), before reading it as the run's
        changed = imported.fingerprint() != meta["hf_fingerprint"] or (  # and its MTP layers' files, if trained
            model.cfg.trained_mtp_layers and imported.fingerprint(mtp=True) != meta.get("mtp", {}).get("fingerprint"))
        if changed:
            raise ConfigError("checkpoint.resume", f"{source} has changed since it was imported into {path}; "
                              "import it again with mop convert from-hf")
    with HFWeights(source, model.cfg) as weights:  # the run's model: its trained MTP depths read too
        write_weights(model, views, weights.rows, optimizer)
        read_buffers(model, weights)


@torch.no_grad()
def read_buffers(model, weights: HFWeights) -> None:
    """The model's buffers (whole on every rank) from a Hugging Face directory."""
    for name, buffer in named_buffers(model).items():
        buffer.copy_(weights.rows(name, buffer.shape, 0, buffer.shape[0]))
