"""Config loading: TOML + overrides, strict validation with one-line errors, presets, and CLI exit codes."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mop.cli import main
from mop.config import Config, ConfigError, field_docs, load_config, sections
from mop.parallel import LayoutError
from mop.settle import settle

ROOT = Path(__file__).resolve().parent.parent


def test_debug_toml_equals_the_embedded_default():
    assert load_config(ROOT / "configs/debug.toml") == Config()


@pytest.mark.parametrize("preset", sorted(path.stem for path in (ROOT / "configs").glob("*.toml")))
def test_every_shipped_config_loads_and_describes_a_valid_model(preset):
    config = load_config(ROOT / f"configs/{preset}.toml")
    assert config.model.validate() == []
    if not preset.startswith(("debug", "long-context")):  # the real-shape presets
        assert config.model.vocab_size > 30000 and config.model.hidden >= 2048


def test_qwen3_preset_has_the_published_shape():
    m = load_config(ROOT / "configs/qwen3-30b-a3b.toml").model
    assert (m.hidden, m.layers, m.heads, m.kv_heads, m.head_dim, m.experts, m.top_k, m.expert_intermediate) == (
        2048, 48, 32, 4, 128, 128, 8, 768)


def test_overrides_are_typed_and_applied_after_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 7\n[data]\nsource = 'a.txt'\n")
    config = load_config(path, ["--train.steps=20", "--optim.lr=1e-4", "--optim.offload=true",
                                "--log.run_dir=123", "--parallel.strategy=mop", "--parallel.nproc=2"])
    assert config.train.steps == 20 and config.optim.lr == 1e-4 and config.optim.offload is True
    assert config.log.run_dir == "123" and config.data.source == "a.txt" and config.parallel.strategy == "mop"


def test_int_is_accepted_for_a_float():
    assert load_config(None, ["--optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("args, key, hint", [
    (["--train.stpes=3"], "train.stpes", "did you mean 'steps'"),
    (["--trian.steps=3"], "trian", "did you mean 'train'"),
    (["--train.steps=abc"], "train.steps", "expects int"),
    (["--train.steps=2.5"], "train.steps", "expects int"),
    (["--log.tensorboard=1"], "log.tensorboard", "expects bool"),
    (["--optim.offload=1"], "optim.offload", "must be one of 'auto', True, False"),
    (["--parallel.strategy=ddp"], "parallel.strategy", "must be one of"),
    (["--train.steps=0"], "train.steps", ">= 1"),
    (["--optim.beta2=1.0"], "optim.beta2", "[0, 1)"),
    (["--model.kv_heads=3"], "model.kv_heads", "must divide"),
    (["--model.top_k=9"], "model.top_k", "exceeds"),
    (["--parallel.strategy=reference", "--parallel.nproc=2"], "parallel.strategy", "one process"),
    (["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--data.seq_len=255"],
     "data.seq_len", "not divisible"),
    (["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.expert=4", "--model.experts=6", "--model.top_k=2"],
     "parallel.expert", "model.experts"),
    (["--train.global_batch=6", "--train.micro_batch=4"], "train.global_batch", "multiple"),
    (["--model.tie_embeddings=true", "--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.vocab=2"],
     "model.tie_embeddings", "parallel.vocab=1"),
    (["train.steps=3"], "train.steps=3", "--section.key=value"),
    (["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=4", "--model.heads=6", "--model.kv_heads=2"],
     "parallel.sequence", "model.heads=6"),
    (["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.attention_head_chunks=4"],
     "parallel.attention_head_chunks", "heads per rank"),
    (["--parallel.attention_head_chunks=-1"], "parallel.attention_head_chunks", ">= 1"),
    (["--train.offload_activations=true", "--train.activation_checkpointing=none"], "train.offload_activations",
     "activation_checkpointing=full"),
])
def test_bad_settings_name_the_key_and_the_fix(args, key, hint):
    with pytest.raises(ConfigError) as err:
        settle(load_config(None, args), fit_memory=False)
    assert err.value.key == key
    assert hint in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("setting", ["--parallel.sequence=3", "--parallel.vocab=3", "--parallel.expert=-2"])
def test_impossible_layouts_name_the_setting_and_the_divisors(setting):
    with pytest.raises(LayoutError) as err:
        settle(load_config(None, ["--parallel.strategy=mop", "--parallel.nproc=4", setting]), fit_memory=False)
    assert setting.removeprefix("--").split("=")[0] in str(err.value) and "1, 2, 4" in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_validation_uses_the_real_world_size():
    config = load_config(None, ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2"])
    with pytest.raises(LayoutError, match="parallel.sequence"):
        settle(config, world=3, fit_memory=False)


def test_every_field_has_a_docstring():
    for cls in sections().values():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_cli_exits_2_with_one_line_on_a_bad_setting(capsys):
    assert main(["train", "--train.stpes=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.stpes" in err and "steps" in err


def test_cli_rejects_stray_arguments():
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "configs/debug.toml", "--verbose"])
    assert exit_info.value.code == 2


def test_cli_help_lists_every_setting():
    out = subprocess.run([sys.executable, "-m", "mop.cli", "train", "--help"], capture_output=True, text=True, check=True).stdout
    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            assert f"{section}.{f.name} =" in out


def test_automatic_settings_follow_the_strategy_and_the_world_size():
    mop = settle(load_config(), fit_memory=False)  # the embedded default: the full layout on 2 local ranks
    p = mop.parallel
    assert (p.strategy, p.nproc, p.sequence, p.expert, p.vocab, p.expert_balance) == ("mop", 2, 2, 2, 2, "llep")
    assert mop.optim.offload is True
    on_eight = settle(load_config(), world=8, fit_memory=False).parallel  # 4 heads, 8 experts, seq_len 256
    assert (on_eight.sequence, on_eight.expert, on_eight.vocab) == (4, 8, 8)
    # Two nodes of 4 ranks: the automatic groups stay inside a node; an explicit degree may cross.
    two_nodes = settle(load_config(), world=8, local_world=4, fit_memory=False).parallel
    assert (two_nodes.sequence, two_nodes.expert, two_nodes.vocab) == (4, 4, 4)
    across = settle(load_config(None, ["--parallel.nproc=8", "--parallel.expert=8"]), world=8, local_world=4, fit_memory=False).parallel
    assert across.expert == 8
    for strategy, world in (("reference", 1), ("fsdp2", 2)):
        config = settle(load_config(None, [f"--parallel.strategy={strategy}"]), fit_memory=False)
        p = config.parallel
        assert (p.nproc, p.sequence, p.expert, p.vocab, p.expert_balance) == (world, 1, 1, 1, "ep")
        assert config.optim.offload is False
    explicit = settle(load_config(None, ["--parallel.sequence=1", "--optim.offload=false"]), fit_memory=False).parallel
    assert (explicit.sequence, explicit.expert) == (1, 2)


def pretend_gpus(monkeypatch, count: int) -> None:
    """This CPU machine seen as one with `count` visible GPUs of 80 GiB (only what `visible_gpus` and
    `memory_budget` read)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: count > 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: count)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_automatic_nproc_is_one_rank_per_visible_gpu(monkeypatch, gpus):
    pretend_gpus(monkeypatch, gpus)
    config = settle(load_config(), fit_memory=False)
    assert config.parallel.nproc == gpus
    assert config.parallel.sequence == math.gcd(gpus, 4)  # the debug model's 4 heads
    assert settle(load_config(None, ["--train.device=cpu"]), fit_memory=False).parallel.nproc == 2  # the CPU's default
    assert settle(load_config(None, ["--parallel.strategy=reference"]), fit_memory=False).parallel.nproc == 1


def test_more_local_ranks_than_gpus_is_one_line_naming_nproc(monkeypatch, capsys):
    pretend_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"parallel.nproc: 2 ranks on this node but 1 visible GPU.*--parallel.nproc=1"):
        settle(load_config(None, ["--parallel.nproc=2"]), fit_memory=False)
    assert main(["train", "--parallel.nproc=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.nproc" in err
    # The CPU takes any number of local ranks, and a world torchrun started is checked per node instead.
    assert load_config(None, ["--parallel.nproc=2", "--train.device=cpu"]).parallel.nproc == 2
    assert settle(load_config(None, ["--parallel.nproc=8", "--train.device=cpu"]), world=8, fit_memory=False).parallel.nproc == 8


def test_torchrun_with_more_ranks_on_a_node_than_gpus_names_nproc_per_node(monkeypatch):
    from mop.train import setup_runtime

    pretend_gpus(monkeypatch, 2)
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"4 ranks on this node but 2 visible GPU.*--nproc_per_node=2"):
        setup_runtime(load_config(None))
