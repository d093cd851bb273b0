"""The bad-input battery (issue 17): every way to hand `mop` bad input ends with exit code 2 and
exactly one line on stderr, `mop: error: ...`, naming the setting or file at fault and how to fix
it; never a traceback, never a second line.

Covered, one table row each:
- config: unknown sections and keys (with a did-you-mean), wrong types, out-of-range values,
  impossible layouts, mop-only settings under the fsdp2 baseline, missing or invalid TOML files,
  malformed overrides;
- data: missing, empty, non-UTF-8, malformed (.jsonl lines, .parquet columns, .bin sizes and
  dtypes) and too-small sources;
- tokenizer: missing or unreadable tokenizer.json, no end-of-text token, more ids than
  model.vocab_size;
- checkpoint: resuming something that is no checkpoint, damaged shards or mop.json, another
  model's checkpoint, another data stream's, an import whose HF directory is gone or changed;
- convert: usage errors, to-hf of a non-checkpoint or into an unwritable place, from-hf of a bad
  or incomplete HF directory (config.json, safetensors, index) or into an existing or unwritable place;
- evaluation: held-out splits too small or leaving nothing to train on, a missing or too small
  eval.source;
- directory: log.run_dir / checkpoint.dir that cannot be written or already hold a run;
- plan: an unknown model, a bad model description (TOML or config.json), a bad cluster or context;
- adapters: LoRA settings out of range, targets that match nothing, a base that is no model or
  another model, settings that cannot carry LoRA, resuming across full and LoRA runs or on another base,
  exporting or merging what is no LoRA checkpoint, merging onto another base or as published
  without a published base.

Every case runs the real command line. Errors found before any rank starts run in-process
(`mop.cli.main`, stderr read with `capfd`) in well under a second; those raised inside a rank
(data, tokenizer, resume) run the one-process reference strategy in-process too, where a Python
warning (which the terminal would show as a second line) fails the case. A few go through a
2-rank launch of the default mop strategy in a fresh `python -m mop.cli` process: there the
launcher's and torch's loggers write to the real stderr, as they do on a terminal (in-process,
pytest's capture hides them), so that a rank's error is shown to reach the terminal as one line.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

import mop
from mop.cli import main
from test_data import _train_bpe
from test_data_sources import write_bin
from test_rollouts_data import npy_bytes
from test_train import TINY, TINY_RUN

TEXT = "A document long enough to fill a few sequences of the tiny model. " * 8


# ---------------------------------------------------------------- fixtures built once per module


@pytest.fixture(scope="module")
def saved_step(tmp_path_factory) -> Path:
    """A checkpoint of the tiny reference model after 2 steps (cases damage copies of it)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert main(["train", *TINY, "--train.steps=2", f"--log.run_dir={run_dir}"]) == 0
    return run_dir / "checkpoints/step_2"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, saved_step) -> Path:
    """That checkpoint as a Hugging Face directory (cases damage copies of it)."""
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert main(["convert", "to-hf", str(saved_step), str(out), "--dtype=float32"]) == 0
    return out


@pytest.fixture(scope="module")
def lora_step(tmp_path_factory) -> Path:
    """A LoRA checkpoint of the tiny reference model after 2 steps, over its own initial weights."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    assert main(["train", *TINY, *LORA, "--train.steps=2", f"--log.run_dir={run_dir}"]) == 0
    return run_dir / "checkpoints/step_2"


class Scene:
    """What one case builds on: its own directory, and on demand copies of the module's checkpoint
    and HF export."""

    def __init__(self, tmp: Path, request):
        self.tmp, self._request = tmp, request

    def path(self, name: str) -> Path:
        return self.tmp / name

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def train(self, *settings: str) -> list[str]:
        """`mop train` of the tiny reference run (one step, in this case's run directory)."""
        return ["train", *TINY, "--train.steps=1", f"--log.run_dir={self.path('run')}", *settings]

    def launch(self, *settings: str) -> list[str]:
        """`mop train` of the tiny model on 2 launched ranks, the default mop strategy and layout."""
        return ["train", *TINY_RUN, "--train.steps=1", "--parallel.nproc=2", f"--log.run_dir={self.path('run')}",
                *settings]

    @cached_property
    def step(self) -> Path:
        """A copy of the module's checkpoint, free to damage."""
        return Path(shutil.copytree(self._request.getfixturevalue("saved_step"), self.path("step_2")))

    @cached_property
    def lora_step(self) -> Path:
        """The module's LoRA checkpoint (read only)."""
        return self._request.getfixturevalue("lora_step")

    @cached_property
    def hf(self) -> Path:
        """A copy of the module's HF export, free to damage."""
        return Path(shutil.copytree(self._request.getfixturevalue("exported"), self.path("hf")))


# ---------------------------------------------------------------- setups too long for a lambda


def with_config(s: Scene, path: Path | str) -> list[str]:
    """`mop train PATH ...`, the tiny run's settings overriding the file's."""
    return ["train", str(path), *s.train()[1:]]


def config_file(s: Scene, content: str | bytes) -> list[str]:
    """`mop train bad.toml ...` with a config file of this content."""
    return with_config(s, s.write("bad.toml", content))


def jsonl(s: Scene, *lines: str) -> str:
    return f"--data.source={s.write('docs.jsonl', chr(10).join(lines) + chr(10))}"


QWEN3 = Path(mop.__file__).parent / "data" / "assets" / "qwen3"
CONVERSATION = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
PAIR = {"prompt": "Say", "chosen": " yes", "rejected": " no"}


def rows_of(s: Scene, kind: str, name: str, rows: list) -> list[str]:
    """`mop train` of chat or preference rows (a list of dicts: jsonl, or parquet by `name`'s suffix;
    bytes: jsonl lines as they are)."""
    path = s.path(name)
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return s.train(f"--data.format={kind}", f"--data.tokenizer={QWEN3}", "--model.vocab_size=584",
                   "--data.seq_len=256", f"--data.source={path}")


def parquet_without_text(s: Scene) -> list[str]:
    pq.write_table(pa.table({"body": [TEXT, TEXT]}), s.path("docs.parquet"))
    return s.train(f"--data.source={s.path('docs.parquet')}")


def bin_in_other_dtype(s: Scene) -> list[str]:
    """uint16 ids read as uint32: pairs of ids become ids far beyond the vocabulary."""
    write_bin(s.path("tokens.bin"), [TEXT] * 4, np.uint16)
    return s.train(f"--data.source={s.path('tokens.bin')}", "--data.bin_dtype=uint32")


def tokenizer(s: Scene, *special: str) -> str:
    """A 400-id BPE tokenizer.json with these special tokens (default: an end-of-text token)."""
    s.path("tok").mkdir(exist_ok=True)
    return str(_train_bpe(s.path("tok/tokenizer.json"), special=special or ("<|endoftext|>",)))


def tokenizer_with_bad_config(s: Scene) -> list[str]:
    path = tokenizer(s)
    s.write("tok/tokenizer_config.json", "{eos_token: ")
    return s.train(f"--data.tokenizer={path}", "--model.vocab_size=512")


def truncated_shard(s: Scene) -> Path:
    """The checkpoint copy, its first shard file cut to 100 bytes."""
    shard = sorted(s.step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return s.step


def missing_shard(s: Scene) -> Path:
    sorted(s.step.glob("*.distcp"))[0].unlink()
    return s.step


def missing_metadata(s: Scene) -> Path:
    """The checkpoint copy without DCP's `.metadata` (its index of the shards)."""
    (s.step / ".metadata").unlink()
    return s.step


def with_meta(s: Scene, text: str) -> Path:
    (s.step / "mop.json").write_text(text)
    return s.step


def meta_without(s: Scene, key: str) -> Path:
    meta = json.loads((s.step / "mop.json").read_text())
    del meta[key]
    return with_meta(s, json.dumps(meta))


def resume_import(s: Scene, change_hf: Callable[[Path], object]) -> list[str]:
    """Fine-tune an import of the HF export after `change_hf` changed the HF directory."""
    imported = s.path("imported")
    assert main(["convert", "from-hf", str(s.hf), str(imported)]) == 0
    change_hf(s.hf)
    return [*with_config(s, imported / "model.toml"), f"--checkpoint.resume={imported}"]


def rewrite_weights(hf: Path, keep: Callable[[str], bool] = lambda key: True) -> None:
    """Save the HF directory's weights again, only the tensors `keep` keeps, in another order."""
    tensors = load_file(hf / "model.safetensors")
    save_file({k: tensors[k] for k in sorted(tensors, reverse=True) if keep(k)}, hf / "model.safetensors")


def without(directory: Path, name: str) -> Path:
    (directory / name).unlink()
    return directory


def to_hf(s: Scene, checkpoint: Path, *options: str, out: Path | None = None) -> list[str]:
    return ["convert", "to-hf", str(checkpoint), str(out or s.path("out")), *options]


def from_hf(s: Scene, hf_dir: Path, into: Path | None = None) -> list[str]:
    return ["convert", "from-hf", str(hf_dir), str(into or s.path("imported"))]


def hf_config(s: Scene, **changes) -> list[str]:
    """Import the HF export with these changes to its config.json."""
    config = json.loads((s.hf / "config.json").read_text())
    (s.hf / "config.json").write_text(json.dumps({**config, **changes}))
    return from_hf(s, s.hf)


def hf_without_a_tensor(s: Scene) -> list[str]:
    rewrite_weights(s.hf, keep=lambda key: key != "model.norm.weight")
    return hf_config(s)


def hf_weights(s: Scene, content: bytes | None) -> list[str]:
    """The HF export with model.safetensors replaced by `content` (None: removed)."""
    weights = s.hf / "model.safetensors"
    weights.unlink() if content is None else weights.write_bytes(content)
    return hf_config(s)


def truncated_weights(s: Scene) -> list[str]:
    weights = (s.hf / "model.safetensors").read_bytes()
    return hf_weights(s, weights[: len(weights) // 2])


def hf_index(s: Scene, index: dict) -> list[str]:
    """The HF export as if sharded: model.safetensors replaced by this index."""
    (s.hf / "model.safetensors.index.json").write_text(json.dumps(index))
    return hf_weights(s, None)


def existing_run(s: Scene) -> Scene:
    """A finished run (metrics and a checkpoint) in the case's run directory."""
    assert main(s.train()) == 0
    return s


def blocker(s: Scene) -> Path:
    """A regular file: nothing can be created under it."""
    return s.write("a-file", "")


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Scene], list[str]]
    names: tuple[str, ...]  # what the line must name: the setting and/or the file
    fresh_process: bool = False  # run as `python -m mop.cli` (launched ranks), not in-process


def case(id: str, argv: Callable[[Scene], list[str]], *names: str) -> Case:
    return Case(id, argv, names)


def launched(id: str, argv: Callable[[Scene], list[str]], *names: str) -> Case:
    """A case whose error is raised inside ranks of a 2-rank launch (see the module docstring)."""
    return Case(id, argv, names, fresh_process=True)


def fast_loop_param(bad: Case):
    """A pytest param of `bad`; a launch takes about 10 s, so launched cases are left out of the fast loop."""
    return pytest.param(bad, id=bad.id, marks=pytest.mark.slow if bad.fresh_process else ())


CONFIG = [
    case("unknown-key", lambda s: s.train("--train.stpes=3"), "train.stpes", "did you mean 'steps'"),
    case("unknown-section", lambda s: s.train("--trian.steps=3"), "trian", "did you mean 'train'"),
    case("not-an-int", lambda s: s.train("--train.steps=abc"), "train.steps", "expects int"),
    case("float-for-int", lambda s: s.train("--train.steps=2.5"), "train.steps", "expects int"),
    case("not-a-bool", lambda s: s.train("--log.tensorboard=1"), "log.tensorboard", "expects bool"),
    case("not-a-choice", lambda s: s.train("--parallel.strategy=ddp"), "parallel.strategy", "must be one of"),
    case("zero-steps", lambda s: s.train("--train.steps=0"), "train.steps", ">= 1"),
    case("negative-lr", lambda s: s.train("--optim.lr=-1"), "optim.lr", ">= 0"),
    case("beta-out-of-range", lambda s: s.train("--optim.beta2=1.0"), "optim.beta2", "[0, 1)"),
    case("min-lr-ratio-out-of-range", lambda s: s.train("--optim.min_lr_ratio=2"), "optim.min_lr_ratio"),
    case("odd-head-dim", lambda s: s.train("--model.head_dim=15"), "model.head_dim", "even"),
    case("speculative-without-host-optimizer", lambda s: s.train("--optim.speculative=false"), "optim.speculative",
         "--optim.offload=true"),
    case("kv-heads-not-dividing", lambda s: s.train("--model.heads=4", "--model.kv_heads=3"), "model.kv_heads"),
    case("top-k-above-experts", lambda s: s.train("--model.top_k=9"), "model.top_k", "model.experts"),
    case("unknown-model-family", lambda s: s.train("--model.family=llama"), "model.family", "qwen3_moe"),
    case("batch-not-a-multiple", lambda s: s.train("--train.global_batch=6", "--train.micro_batch=4"),
         "train.global_batch"),
    case("reference-on-two-ranks", lambda s: s.train("--parallel.nproc=2"), "parallel.strategy"),
    case("sequence-not-dividing-world", lambda s: s.launch("--parallel.nproc=4", "--parallel.sequence=3"),
         "parallel.sequence"),
    case("sequence-not-dividing-heads", lambda s: s.launch("--parallel.nproc=4", "--parallel.sequence=4"),
         "parallel.sequence", "model.heads"),
    case("seq-len-not-divisible", lambda s: s.launch("--parallel.sequence=2", "--data.seq_len=31"), "data.seq_len"),
    case("expert-not-dividing-experts", lambda s: s.launch("--parallel.nproc=4", "--parallel.expert=4",
                                                           "--model.experts=6"), "parallel.expert"),
    case("tied-embeddings-vocab-parallel", lambda s: s.launch("--model.tie_embeddings=true", "--parallel.vocab=2"),
         "model.tie_embeddings"),
    case("offload-activations-alone", lambda s: s.train("--train.offload_activations=true",
                                                          "--train.activation_checkpointing=none"),
         "train.offload_activations"),
    case("fsdp2-vocab-parallel", lambda s: s.launch("--parallel.strategy=fsdp2", "--parallel.vocab=2"),
         "parallel.vocab", "fsdp2"),
    case("fsdp2-llep", lambda s: s.launch("--parallel.strategy=fsdp2", "--parallel.expert_balance=llep"),
         "parallel.expert_balance"),
    case("fsdp2-host-optimizer", lambda s: s.launch("--parallel.strategy=fsdp2", "--optim.offload=true"),
         "optim.offload"),
    case("fsdp-offload-under-mop", lambda s: s.launch("--parallel.fsdp_cpu_offload=true"),
         "parallel.fsdp_cpu_offload"),
    case("unknown-command", lambda s: ["trian"], "'trian'", "see mop --help"),
    case("missing-config-file", lambda s: with_config(s, s.path("nope.toml")), "nope.toml", "not found"),
    case("invalid-toml", lambda s: config_file(s, "[train\nsteps="), "bad.toml", "not valid TOML"),
    case("non-utf8-toml", lambda s: config_file(s, b"[train]\nsteps = 1  # caf\xe9\n"), "bad.toml", "not valid TOML"),
    case("wrong-type-in-file", lambda s: config_file(s, "[model]\nhidden = \"64\"\n"), "model.hidden", "expects int"),
    case("unknown-key-in-file", lambda s: config_file(s, "[train]\nstpes = 3\n"), "train.stpes"),
    case("scalar-for-section", lambda s: config_file(s, "train = 3\n"), "train", "is a section"),
    case("override-without-value", lambda s: s.train("--train.steps"), "--train.steps", "--section.key=value"),
    case("eval-fraction-out-of-range", lambda s: s.train("--eval.every=1", "--eval.fraction=1.5"), "eval.fraction"),
    case("eval-sequences-not-a-multiple", lambda s: s.train("--eval.every=1", "--eval.sequences=3"),
         "eval.sequences", "train.micro_batch"),
    case("zero-collective-timeout", lambda s: s.train("--parallel.timeout_s=0"), "parallel.timeout_s", ">= 1"),
    case("zero-stop-grace", lambda s: s.train("--checkpoint.stop_grace_s=0"), "checkpoint.stop_grace_s"),
    case("override-without-section", lambda s: s.train("--steps=3"), "--steps=3", "--section.key=value"),
    case("override-without-dashes", lambda s: s.train("train.steps=3"), "train.steps=3", "--section.key=value"),
]

DATA = [
    case("missing-source", lambda s: s.train(f"--data.source={s.path('missing.txt')}"), "data.source", "missing.txt"),
    launched("missing-source-launched", lambda s: s.launch(f"--data.source={s.path('missing.txt')}"),
         "data.source", "missing.txt"),
    case("empty-file", lambda s: s.train(f"--data.source={s.write('empty.txt', '')}"), "data.source", "empty.txt"),
    case("non-utf8-text", lambda s: s.train(f"--data.source={s.write('latin1.txt', b'caf' + bytes([233]) * 99)}"),
         "data.source", "latin1.txt", "UTF-8"),
    case("jsonl-bad-line", lambda s: s.train(jsonl(s, json.dumps({"text": TEXT}), "{oops")),
         "data.source", "docs.jsonl row 2"),
    case("jsonl-missing-field", lambda s: s.train(jsonl(s, json.dumps({"body": TEXT}))),
         "data.text_field", "docs.jsonl row 1"),
    case("jsonl-text-not-a-string", lambda s: s.train(jsonl(s, json.dumps({"text": 42}))),
         "data.text_field", "docs.jsonl row 1"),
    case("parquet-without-column", parquet_without_text, "data.text_field", "docs.parquet"),
    case("chat-row-not-utf8", lambda s: rows_of(s, "chat", "chat.jsonl", [CONVERSATION] * 199 + [
        json.dumps(CONVERSATION).replace("Hello", "H\u00e9llo").encode("latin-1") + b"\n"]),
         "data.source", "chat.jsonl row 200", "not valid UTF-8"),
    case("preference-parquet-row", lambda s: rows_of(s, "preference", "pairs.parquet", [PAIR, {**PAIR, "rejected": None}]),
         "data.source", "pairs.parquet row 2", "no 'rejected'"),
    case("parquet-unreadable", lambda s: s.train(f"--data.source={s.write('junk.parquet', b'not parquet')}"),
         "data.source", "junk.parquet"),
    case("bin-odd-size", lambda s: s.train(f"--data.source={s.write('odd.bin', bytes(101))}"),
         "data.bin_dtype", "odd.bin"),
    case("bin-other-dtype", bin_in_other_dtype, "data.bin_dtype", "tokens.bin"),
    case("unsupported-extension", lambda s: s.train(f"--data.source={s.write('docs.csv', TEXT)}"),
         "data.source", "docs.csv"),
    case("directory-without-data", lambda s: s.train(f"--data.source={s.write('dir/notes.md', TEXT).parent}"),
         "data.source", "dir"),
    case("too-little-data", lambda s: s.train(f"--data.source={s.write('short.txt', 'tiny')}"), "data.seq_len"),
]

TOKENIZER = [
    case("missing-tokenizer", lambda s: s.train(f"--data.tokenizer={s.path('nope.json')}"),
         "data.tokenizer", "nope.json"),
    case("unreadable-tokenizer", lambda s: s.train(f"--data.tokenizer={s.write('tokenizer.json', '{not json')}"),
         "data.tokenizer", "tokenizer.json"),
    case("no-eos-token", lambda s: s.train(f"--data.tokenizer={tokenizer(s, '<unk>', '<sep>')}",
                                           "--model.vocab_size=512"), "data.eos_token", "tokenizer.json"),
    case("eos-token-not-in-vocab", lambda s: s.train(f"--data.tokenizer={tokenizer(s)}", "--model.vocab_size=512",
                                                     "--data.eos_token=<nope>"), "data.eos_token", "<nope>"),
    case("bad-tokenizer-config", tokenizer_with_bad_config, "data.tokenizer", "tokenizer_config.json"),
    case("vocab-above-model", lambda s: s.train(f"--data.tokenizer={tokenizer(s)}"), "model.vocab_size"),
    launched("vocab-above-model-launched", lambda s: s.launch(f"--data.tokenizer={tokenizer(s)}"), "model.vocab_size"),
]

EVALUATION = [
    case("eval-sequences-beyond-the-held-out-split", lambda s: s.train("--eval.every=1", "--eval.sequences=100000"),
         "eval.sequences", "eval.fraction"),
    case("eval-fraction-leaving-nothing-to-train", lambda s: s.train(
        f"--data.source={s.write('small.txt', TEXT)}", "--eval.every=1", "--eval.fraction=0.99", "--eval.sequences=2"),
         "eval.fraction"),
    case("eval-source-missing", lambda s: s.train("--eval.every=1", f"--eval.source={s.path('held_out.txt')}"),
         "eval.source", "held_out.txt"),
    case("eval-source-too-small", lambda s: s.train("--eval.every=1", f"--eval.source={s.write('held.txt', 'tiny')}"),
         "eval.source"),
]

CHECKPOINT = [
    case("resume-not-a-checkpoint", lambda s: s.train(f"--checkpoint.resume={s.write('empty/x', '').parent}"),
         "checkpoint.resume", "empty"),
    case("resume-truncated-shard", lambda s: s.train(f"--checkpoint.resume={truncated_shard(s)}"),
         "checkpoint.resume", "step_2"),
    case("resume-missing-shard", lambda s: s.train(f"--checkpoint.resume={missing_shard(s)}"),
         "checkpoint.resume", "step_2"),
    launched("resume-missing-shard-launched", lambda s: s.launch(f"--checkpoint.resume={missing_shard(s)}"),
         "checkpoint.resume", "step_2"),
    case("resume-missing-metadata", lambda s: s.train(f"--checkpoint.resume={missing_metadata(s)}"),
         "checkpoint.resume", "step_2", ".metadata"),
    launched("resume-missing-metadata-launched", lambda s: s.launch(f"--checkpoint.resume={missing_metadata(s)}"),
             "checkpoint.resume", "step_2", ".metadata"),
    case("resume-invalid-meta", lambda s: s.train(f"--checkpoint.resume={with_meta(s, '{not json')}"),
         "checkpoint.resume", "step_2"),
    case("resume-meta-not-an-object", lambda s: s.train(f"--checkpoint.resume={with_meta(s, '[]')}"),
         "checkpoint.resume", "step_2"),
    case("resume-empty-meta", lambda s: s.train(f"--checkpoint.resume={with_meta(s, '{}')}"),
         "checkpoint.resume", "step_2"),
    case("resume-meta-without-config", lambda s: s.train(f"--checkpoint.resume={meta_without(s, 'config')}"),
         "checkpoint.resume", "step_2"),
    case("resume-other-model", lambda s: s.train("--model.hidden=64", f"--checkpoint.resume={s.step}"),
         "model.hidden", "step_2"),
    case("resume-other-seed", lambda s: s.train("--train.seed=1", f"--checkpoint.resume={s.step}"), "train.seed"),
    case("resume-other-corpus", lambda s: s.train(f"--data.source={s.write('other.txt', TEXT)}",
                                                  f"--checkpoint.resume={s.step}"), "data.source"),
    case("resume-import-of-removed-hf-dir", lambda s: resume_import(s, shutil.rmtree), "checkpoint.resume", "hf"),
    case("resume-import-of-changed-hf-dir", lambda s: resume_import(s, rewrite_weights), "checkpoint.resume",
         "has changed"),
    case("resume-import-with-another-tokenizer", lambda s: [*resume_import(s, lambda hf: None), "--data.tokenizer=byte"],
         "data.tokenizer", "checkpoint.allow_tokenizer_change"),
]

CONVERT = [
    case("convert-missing-argument", lambda s: ["convert", "to-hf", str(s.step)], "out", "mop convert to-hf --help"),
    case("convert-stray-option", lambda s: to_hf(s, s.step, "--fast"), "--fast"),
    case("to-hf-of-non-checkpoint", lambda s: to_hf(s, s.write("plain/x", "").parent), "plain", "mop.json"),
    case("to-hf-of-damaged-checkpoint", lambda s: to_hf(s, truncated_shard(s)), "step_2", "damaged"),
    case("to-hf-inexpressible", lambda s: to_hf(s, s.step, "--model-type=mixtral"), "mixtral", "model.qk_norm"),
    case("to-hf-into-a-file", lambda s: to_hf(s, s.step, out=blocker(s) / "out"), "a-file"),
    case("from-hf-without-config", lambda s: from_hf(s, s.write("bare/x", "").parent), "config.json", "bare"),
    case("from-hf-invalid-config", lambda s: from_hf(s, s.write("hf/config.json", "{oops").parent),
         "config.json", "invalid JSON"),
    case("from-hf-config-not-utf8", lambda s: from_hf(s, s.write("hf/config.json", b'{"a": "\xe9"}').parent),
         "config.json", "invalid JSON"),
    case("from-hf-config-not-an-object", lambda s: from_hf(s, s.write("hf/config.json", "[1]").parent),
         "config.json", "not an object"),
    case("from-hf-config-wrong-type", lambda s: hf_config(s, hidden_size="64"), "config.json", "hidden expects int"),
    case("from-hf-unsupported-type", lambda s: hf_config(s, model_type="llama"), "model_type='llama'"),
    case("from-hf-without-weights", lambda s: hf_weights(s, None), "model.safetensors", "hf"),
    case("from-hf-corrupt-weights", lambda s: hf_weights(s, b"garbage" * 10), "model.safetensors", "not a readable"),
    case("from-hf-truncated-weights", truncated_weights, "model.safetensors", "not a readable"),
    case("from-hf-index-without-map", lambda s: hf_index(s, {"metadata": {}}), "model.safetensors.index.json",
         "weight_map"),
    case("from-hf-index-missing-shard", lambda s: hf_index(s, {"weight_map": {"model.norm.weight": "part-1.bin"}}),
         "part-1.bin", "missing"),
    case("from-hf-missing-tensor", hf_without_a_tensor, "model.norm.weight", "hf"),
    case("from-hf-without-tokenizer", lambda s: from_hf(s, without(s.hf, "tokenizer.json")), "tokenizer.json",
         "--tokenizer"),
    case("from-hf-into-existing", lambda s: from_hf(s, s.hf, into=s.write("taken/x", "").parent),
         "taken", "already exists"),
    case("from-hf-into-a-file", lambda s: from_hf(s, s.hf, into=blocker(s) / "imported"), "a-file"),
]

DIRECTORY = [
    case("run-dir-under-a-file", lambda s: s.train(f"--log.run_dir={blocker(s) / 'run'}"), "log.run_dir", "a-file"),
    case("run-dir-is-a-file", lambda s: s.train(f"--log.run_dir={blocker(s)}"), "log.run_dir", "a-file"),
    case("checkpoint-dir-under-a-file", lambda s: s.train(f"--checkpoint.dir={blocker(s) / 'ckpt'}"),
         "checkpoint.dir", "a-file"),
    case("run-dir-holds-a-run", lambda s: existing_run(s).train(), "log.run_dir", "log.overwrite"),
    case("checkpoint-dir-holds-a-run", lambda s: s.train(f"--checkpoint.dir={existing_run(s).path('run/checkpoints')}",
                                                         f"--log.run_dir={s.path('new')}"),
         "checkpoint.dir", "run/checkpoints"),
    launched("run-dir-holds-a-run-launched", lambda s: existing_run(s).launch(), "log.run_dir", "log.overwrite"),
]

def plan(*options: str, model: str = "mop-120b") -> Callable[[Scene], list[str]]:
    return lambda s: ["plan", model, "--nodes", "2", "--context", "128K", *options]


def plan_of(s: Scene, name: str, content: str) -> list[str]:
    """`mop plan` of a model description file of this content."""
    return ["plan", str(s.write(name, content)), "--nodes", "1", "--context", "32K"]


PLAN = [
    case("plan-unknown-model", plan(model="no-such-model"), "MODEL", "mop-120b"),
    case("plan-bad-context", plan("--context", "12Q"), "--context", "128K"),
    case("plan-zero-nodes", lambda s: ["plan", "mop-120b", "--nodes", "0", "--context", "1M"], "--nodes", ">= 1"),
    case("plan-missing-nodes", lambda s: ["plan", "mop-120b", "--context", "1M"], "--nodes"),
    case("plan-unknown-gpu", plan("--gpu", "a100"), "--gpu", "h100"),
    case("plan-mfu-above-one", plan("--mfu", "2"), "--mfu", "(0, 1]"),
    case("plan-no-device-memory", plan("--device-gib", "0"), "--device-gib", "> 0"),
    case("plan-reserve-everything", plan("--reserve-gib", "200"), "--reserve-gib"),
    case("plan-skew-below-one", plan("--routing-skew", "0.5"), "--routing-skew"),
    case("plan-no-context", lambda s: ["plan", "mop-120b", "--nodes", "2"], "--context", "--contexts"),
    case("plan-bad-batch", plan("--global-batch", "-1"), "--global-batch"),
    case("plan-batch-fits-no-layout", lambda s: ["plan", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "3",
                                                 "--context", "32K", "--global-batch", "2"], "--global-batch", "multiple"),
    case("plan-infinite-host-memory", plan("--host-gib", "inf"), "--host-gib", "> 0"),
    case("plan-toml-bad-model", lambda s: plan_of(s, "model.toml", "[model]\nhidden = 0\n"), "model.hidden", ">= 1"),
    case("plan-config-json-unsupported", lambda s: plan_of(s, "config.json", '{"model_type": "llama"}'),
         "config.json", "model_type"),
    case("plan-config-json-broken", lambda s: plan_of(s, "config.json", "{not json"), "config.json"),
]

LORA = ["--train.finetune=lora", "--lora.rank=2"]
ADAPTERS = [
    case("lora-rank-zero", lambda s: s.train(*LORA, "--lora.rank=0"), "lora.rank", ">= 1"),
    case("lora-rank-zero-under-mop", lambda s: s.launch(*LORA, "--lora.rank=0"), "lora.rank", ">= 1"),
    case("lora-resuming-with-another-base-format", lambda s: s.train(*LORA, "--lora.base_format=fp8:16x16",
                                                                     f"--checkpoint.resume={s.lora_step}"),
         "lora.base_format"),
    case("lora-target-matching-nothing", lambda s: s.train(*LORA, "--lora.targets=attention,qq_proj"),
         "lora.targets", "qq_proj"),
    case("lora-router-target", lambda s: s.train(*LORA, "--lora.targets=attention,router"), "lora.targets",
         "router"),
    case("lora-no-targets", lambda s: s.train(*LORA, "--lora.targets=,"), "lora.targets"),
    case("lora-dropout-out-of-range", lambda s: s.train(*LORA, "--lora.dropout=1.5"), "lora.dropout"),
    case("lora-unknown-base-format", lambda s: s.train(*LORA, "--lora.base_format=fp9"), "lora.base_format", "fp8"),
    case("lora-base-not-a-model", lambda s: s.train(*LORA, f"--lora.base={s.path('nowhere')}"), "lora.base",
         "nowhere"),
    case("lora-base-of-another-model", lambda s: s.train(*LORA, f"--lora.base={s.hf}", "--model.hidden=64"),
         "model.hidden", "hf"),
    case("lora-with-fsdp2-cpu-offload", lambda s: s.train(*LORA, "--parallel.strategy=fsdp2",
                                                          "--parallel.fsdp_cpu_offload=true"),
         "parallel.fsdp_cpu_offload"),
    case("lora-resuming-a-full-checkpoint", lambda s: s.train(*LORA, f"--checkpoint.resume={s.step}"),
         "checkpoint.resume", "LoRA"),
    case("full-run-resuming-a-lora-checkpoint", lambda s: s.train(f"--checkpoint.resume={s.lora_step}"),
         "train.finetune", "mop convert merge"),
    case("lora-resuming-on-another-base", lambda s: s.train(*LORA, f"--lora.base={s.hf}",
                                                            f"--checkpoint.resume={s.lora_step}"),
         "lora.base", "initial weights"),
    case("run-dir-holding-a-model", lambda s: s.train(*LORA, f"--lora.base={s.hf}", f"--log.run_dir={s.hf}"),
         "log.run_dir", "Hugging Face model"),
    case("lora-resuming-with-another-rank", lambda s: s.train(*LORA, "--lora.rank=4",
                                                              f"--checkpoint.resume={s.lora_step}"), "lora.rank"),
    case("to-peft-of-a-full-checkpoint", lambda s: ["convert", "to-peft", str(s.step), str(s.path("adapter"))],
         "step_2", "to-hf"),
    case("merge-of-a-full-checkpoint", lambda s: ["convert", "merge", str(s.step), str(s.path("merged"))],
         "step_2", "LoRA"),
    case("merge-of-no-checkpoint", lambda s: ["convert", "merge", str(s.path("nowhere")), str(s.path("merged"))],
         "nowhere", "step_<N>"),
    case("merge-onto-another-base", lambda s: ["convert", "merge", str(s.lora_step), str(s.path("merged")),
                                               f"--base={s.hf}"], "--base", "initial weights"),
    case("merge-as-published-without-a-published-base",
         lambda s: ["convert", "merge", str(s.lora_step), str(s.path("merged")), "--dtype=published"],
         "--dtype", "bfloat16"),
]

SHIPPED_ROLLOUTS = Path(mop.__file__).parent / "data" / "corpus" / "rollouts.jsonl"


def rollouts(s: Scene, *settings: str, rows: list[dict] | None = None, ranks: int = 1) -> list[str]:
    """`mop train` of recorded rollouts: the shipped ones (the debug model's shape), or `rows`; on 2
    launched ranks with `ranks=2`."""
    source = SHIPPED_ROLLOUTS if rows is None else s.write("rollouts.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    run = s.train if ranks == 1 else s.launch
    return run("--data.format=rollouts", f"--data.source={source}", "--data.seq_len=128", "--model.layers=4",
               "--model.experts=8", "--model.top_k=2", *settings)


ROLLOUT = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "advantage": 1.0}
CUT_NPY = base64.b64encode(npy_bytes(np.zeros((4, 4, 2), np.int64))[:-9]).decode()  # vLLM's routes, cut short
RL = [
    case("rl-cispo-without-its-cap", lambda s: rollouts(s, "--rl.loss_type=cispo"), "rl.epsilon_high", "5.0"),
    case("rl-truncate-without-bounds", lambda s: rollouts(s, "--rl.correction=token_truncate",
                                                          "--rl.correction_max=0"), "rl.correction_max"),
    case("rl-reference-without-kl", lambda s: rollouts(s, "--rl.reference=precomputed"), "rl.reference", "rl.beta"),
    case("rl-checkpoints-inside-a-batch", lambda s: rollouts(s, "--rl.updates_per_batch=2", "--checkpoint.every=3"),
         "checkpoint.every", "rl.updates_per_batch"),
    case("rl-routes-of-another-top-k", lambda s: rollouts(s, rows=[{**ROLLOUT, "routed_experts": [[[0, 1, 2]] * 4] * 4}]),
         "data.source", "rollouts.jsonl row 1", "top_k 2"),
    case("rl-replay-without-routes", lambda s: rollouts(s, "--rl.replay=rollout", rows=[ROLLOUT] * 4), "rl.replay"),
    # issue 64: rows that ended in a rank's traceback or trained silently
    case("rl-routes-neither-npy-nor-int32", lambda s: rollouts(
        s, rows=[{**ROLLOUT, "routed_experts": base64.b64encode(b"hello").decode()}]),
        "rollouts.jsonl row 1", "neither a .npy file", "raw int32"),
    launched("rl-routes-npy-cut-short-launched",
             lambda s: rollouts(s, rows=[{**ROLLOUT, "routed_experts": CUT_NPY}], ranks=2),
             "rollouts.jsonl row 1", ".npy file that cannot be read"),
    case("rl-log-prob-above-zero", lambda s: rollouts(s, rows=[{**ROLLOUT, "sampling_logps": [-0.1, 0.7]}]),
         "rollouts.jsonl row 1", "'sampling_logps' holds 0.7", "at most 0"),
    case("rl-nan-log-prob", lambda s: rollouts(s, rows=[{**ROLLOUT, "sampling_logps": [float("nan"), -0.1]}]),
         "rollouts.jsonl row 1", "'sampling_logps' holds a non-finite value (nan)", "null"),
]
CASES = CONFIG + DATA + EVALUATION + TOKENIZER + CHECKPOINT + CONVERT + DIRECTORY + PLAN + ADAPTERS + RL


def run_cli(argv: list[str]) -> int:
    """The exit code of `mop ARGV` (argparse's own errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


# Python's default filters show these categories only for code in __main__: never on mop's terminal.
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def run_in_process(argv: list[str], capfd) -> tuple[int, str]:
    """`mop ARGV` in this process: its exit code and stderr, with a line for each warning the terminal would show."""
    capfd.readouterr()  # what the setup printed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = run_cli(argv)
    shown = [f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, HIDDEN_WARNINGS)]
    return code, "\n".join([capfd.readouterr().err, *shown])


def run_in_a_fresh_process(argv: list[str]) -> tuple[int, str]:
    """`python -m mop.cli ARGV`: its exit code and its whole stderr, launched ranks and loggers included."""
    root = str(Path(mop.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "mop.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    return done.returncode, done.stderr


@pytest.mark.parametrize("bad", [fast_loop_param(c) for c in CASES])
def test_bad_input_is_one_line_naming_it_with_exit_code_2(bad: Case, tmp_path, request, capfd):
    argv = bad.argv(Scene(tmp_path, request))
    code, err = run_in_a_fresh_process(argv) if bad.fresh_process else run_in_process(argv, capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, lines
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("mop: error: ") and "Traceback" not in line, line
    for name in bad.names:
        assert name in line, (name, line)


def test_the_battery_covers_every_kind_of_input():
    assert len(CASES) >= 45 and len({c.id for c in CASES}) == len(CASES)
    assert all((CONFIG, DATA, EVALUATION, TOKENIZER, CHECKPOINT, CONVERT, DIRECTORY))
