"""A family's own hyper-parameters (`Family.options`, `[model.options]`): read only for the family that
takes them, type-checked, validated by the family, documented by `mop train --help`, kept through
config.json and checkpoints. Played by a test family: qwen3_moe's modules with two options."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from mop.cli import config_reference
from mop.config import Config, ConfigError, apply, load_config, load_model_config, to_dict
from mop.models import qwen3_moe
from mop.models.config import ModelConfig
from mop.models.families import FAMILIES


@dataclass(frozen=True)
class ToyOptions:
    window: int = 0
    """Keys each query sees, itself included (0: all)."""
    sinks: bool = False
    """A learned attention sink per head."""

    def validate(self, model) -> list[tuple[str, str]]:
        return [("window", f"must be >= 0, got {self.window}")] if self.window < 0 else []


@pytest.fixture(autouse=True)
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", dataclasses.replace(qwen3_moe.FAMILY, name="toy", options=ToyOptions))


def test_a_config_file_and_overrides_set_the_familys_options(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text('[model]\nfamily = "toy"\n[model.options]\nwindow = 128\n')
    config = load_config(path, ["--model.options.sinks=true"])
    assert config.model.options == ToyOptions(window=128, sinks=True)
    assert load_model_config(path).options == ToyOptions(window=128)


def test_a_family_without_options_has_none_and_switching_family_resets_the_defaults():
    assert ModelConfig().options is None and ModelConfig(family="toy").options == ToyOptions()
    assert load_config(None, ["--model.family=toy", "--model.family=qwen3_moe"]).model.options is None


@pytest.mark.parametrize("overrides, key, message", [
    (["--model.options.window=128"], "model.options.window",
     "model.family='qwen3_moe' does not take it; it is a key of model.family='toy'"),
    (["--model.family=toy", "--model.options.windw=1"], "model.options.windw", "did you mean 'window'?"),
    (["--model.family=toy", "--model.options.window=abc"], "model.options.window", "expects int"),
])
def test_a_key_the_family_does_not_take_or_a_wrong_value_is_one_line(overrides, key, message):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    assert raised.value.key == key and message in str(raised.value) and "\n" not in str(raised.value)


def test_the_family_validates_its_own_options(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text('[model]\nfamily = "toy"\n[model.options]\nwindow = -1\n')
    with pytest.raises(ConfigError, match=r"^model\.options\.window: must be >= 0, got -1$"):
        load_model_config(path)


def test_options_survive_config_json_and_a_checkpoints_record():
    config = load_config(None, ["--model.family=toy", "--model.options.window=64"])
    written = json.loads(json.dumps(to_dict(config)))
    assert written["model"]["options"] == {"window": 64, "sinks": False}
    assert ModelConfig(**written["model"]) == config.model  # how checkpoints and convert read it back
    assert apply(Config(), {"model": written["model"]}).model == config.model


def test_help_lists_each_familys_options_with_defaults_and_docstrings():
    text = config_reference()
    assert "with model.family = 'toy':" in text
    assert "model.options.window = 0" in text and "Keys each query sees, itself included (0: all)." in text


def test_an_imported_models_toml_keeps_its_options(tmp_path):
    from mop.convert import config_toml

    config = load_config(None, ["--model.family=toy", "--model.options.sinks=true"])
    path = tmp_path / "model.toml"
    path.write_text(config_toml(config))
    assert "[model.options]" in path.read_text() and load_model_config(path) == config.model
