"""Multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's) kept frozen and passed through
(`mop.models.hf.MtpLayers`): from-hf -> fine-tune -> to-hf gives back every MTP tensor as it was,
with the original `num_nextn_predict_layers`; a LoRA merge gives them back as its base publishes
them (fp8 bytes and scales) or dequantized.

The checkpoints' MTP layer is written here as the hub's checkpoints hold it: `model.layers.{L}`
(L = num_hidden_layers) with a whole decoder block's tensors, `enorm`, `hnorm`, `eh_proj [H, 2H]`,
`shared_head.norm`, `shared_head.head` and `embed_tokens`, in a shard of its own.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hf_workflow import fine_tune, write_corpus

from mop.cli import main

transformers = pytest.importorskip("transformers")

MTP_FILE = "model-00002-of-00002.safetensors"


def glm4_config():
    return transformers.Glm4MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=1)


def deepseek_config():
    import test_deepseek_v3

    return test_deepseek_v3.hf_config(vocab_size=300, moe_intermediate_size=24, num_nextn_predict_layers=1)


def hub_folder(folder, config):
    """A random model of `config` saved with its MTP layer added in a shard of its own (module docstring)."""
    from test_hf import randomize

    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(hf, 0, ".mlp.gate.weight")
    hf.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    last, mtp = config.num_hidden_layers - 1, config.num_hidden_layers
    generator = torch.Generator().manual_seed(5)
    layer = {key.replace(f"layers.{last}.", f"layers.{mtp}.", 1): 0.1 * torch.randn(t.shape, generator=generator)
             for key, t in tensors.items() if key.startswith(f"model.layers.{last}.")}
    hidden = config.hidden_size
    prefix = f"model.layers.{mtp}."
    layer.update({prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                  prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                  prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=generator),
                  prefix + "shared_head.norm.weight": torch.ones(hidden),
                  prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                  prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    main_file = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors").rename(folder / main_file)
    save_file(layer, folder / MTP_FILE, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**dict.fromkeys(tensors, main_file), **dict.fromkeys(layer, MTP_FILE)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return layer


def fp8_hub_folder(folder) -> dict:
    """`hub_folder` of DeepSeek-V3 in one file, quantized as DeepSeek-V3 publishes it (fp8 blocks of 16 x 8
    here, the MTP layer's too); what the tests' quantizer dequantizes each weight to."""
    import test_deepseek_v3

    hub_folder(folder, deepseek_config())
    main_file = folder / "model-00001-of-00002.safetensors"  # quantize_fp8 reads model.safetensors
    save_file({**load_file(main_file), **load_file(folder / MTP_FILE)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    for leftover in (main_file, folder / MTP_FILE, folder / "model.safetensors.index.json"):
        leftover.unlink()
    return test_deepseek_v3.quantize_fp8(folder, (16, 8))


def written(folder) -> dict:
    """Every tensor of a written HF directory by name."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


@pytest.mark.parametrize("config", [glm4_config, deepseek_config], ids=["glm4_moe", "deepseek_v3"])
def test_a_fine_tune_writes_back_the_frozen_mtp_layers_as_they_were(tmp_path, capsys, config):
    mtp = hub_folder(tmp_path / "hf", config())
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tokenizer=byte"]) == 0
    assert f"the 1 multi-token-prediction layer(s) of {tmp_path / 'hf'} ({len(mtp)} tensors) stay frozen" in (
        capsys.readouterr().out)
    step = fine_tune(tmp_path / "imported", tmp_path / "run", write_corpus(tmp_path / "corpus.txt"), "--train.steps=2")
    assert "multi-token-prediction layer(s)" in capsys.readouterr().out  # the start line says they stay frozen
    assert main(["convert", "to-hf", str(step), str(tmp_path / "out"), "--dtype=float32"]) == 0
    out, source = written(tmp_path / "out"), written(tmp_path / "hf")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    for key, tensor in mtp.items():
        assert torch.equal(out[key], tensor), key
    assert out.keys() == source.keys()
    trained = [key for key in source if key not in mtp and not torch.equal(out[key], source[key])]
    assert "model.embed_tokens.weight" in trained  # the main model did train
    # the export imports again, its MTP layer set aside as before
    assert main(["convert", "from-hf", str(tmp_path / "out"), str(tmp_path / "again"), "--tokenizer=byte"]) == 0

    assert main(["convert", "to-hf", str(step), str(tmp_path / "without"), "--mtp=drop"]) == 0
    assert not [key for key in written(tmp_path / "without") if key in mtp]
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0

    (tmp_path / "hf").rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["convert", "to-hf", str(step), str(tmp_path / "lost")]) == 2
    message = capsys.readouterr().err.strip()
    assert "--mtp" in message and "is gone" in message and len(message.splitlines()) == 1


def test_a_merge_gives_back_an_fp8_bases_mtp_layers_as_published_or_dequantized(tmp_path):
    from test_lora import base_run

    dequantized = fp8_hub_folder(tmp_path / "hf")
    base_run(tmp_path, "run", f"--lora.base={tmp_path / 'hf'}")
    step = tmp_path / "run" / "checkpoints" / "step_4"
    assert main(["convert", "merge", str(step), str(tmp_path / "published"), "--dtype=published"]) == 0
    assert main(["convert", "merge", str(step), str(tmp_path / "fp32"), "--dtype=float32"]) == 0
    published, exact = written(tmp_path / "published"), written(tmp_path / "fp32")
    mtp_keys = [key for key in load_file(tmp_path / "hf" / "model.safetensors") if key.startswith("model.layers.3.")]
    assert any(key.endswith("_scale_inv") for key in mtp_keys)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as source:
        for key in mtp_keys:  # the stored bytes, fp8 and scales alike
            assert torch.equal(published[key].view(torch.uint8), source.get_tensor(key).view(torch.uint8)), key
            weight = key.removesuffix("_scale_inv")
            expected = dequantized.get(weight, source.get_tensor(weight).float())
            assert torch.equal(exact[weight], expected), weight
    for config in ("published", "fp32"):
        assert json.loads((tmp_path / config / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_to_hf_writes_a_fine_tune_of_an_fp8_checkpoint_as_published_and_keeps_its_config_keys(tmp_path):
    """`to-hf --dtype=published` (issue 63): after a fine-tune of DeepSeek-V3's fp8 form, every weight the
    checkpoint publishes in fp8 comes back as fp8 blocks with their scales (the trained ones re-quantized;
    the frozen MTP layer's stored bytes and scales as they were), every other tensor in the checkpoint's
    dtype, with its quantization_config; and config.json keeps the checkpoint's keys mop does not write
    (`topk_method`, `scoring_func`: vLLM builds DeepSeek-V3's router from them), in every dtype."""
    fp8_hub_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1)  # as DeepSeek-V3 publishes them
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tokenizer=byte"]) == 0
    step = fine_tune(tmp_path / "imported", tmp_path / "run", write_corpus(tmp_path / "corpus.txt"), "--train.steps=2")
    assert main(["convert", "to-hf", str(step), str(tmp_path / "published"), "--dtype=published"]) == 0
    assert main(["convert", "to-hf", str(step), str(tmp_path / "bf16"), "--dtype=bfloat16"]) == 0
    published, source = written(tmp_path / "published"), load_file(tmp_path / "hf" / "model.safetensors")
    assert published.keys() == source.keys()
    for key, tensor in source.items():
        assert published[key].dtype == tensor.dtype, key
        if key.startswith("model.layers.3."):  # the frozen MTP layer: its stored bytes
            assert torch.equal(published[key].view(torch.uint8), tensor.view(torch.uint8)), key
    trained = [key for key in source if key.endswith("_scale_inv") and not key.startswith("model.layers.3.")
               and not torch.equal(published[key], source[key])]
    assert trained  # the fine-tuned weights were re-quantized
    written_config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert written_config["quantization_config"] == config["quantization_config"]
    plain = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in plain and all(
        c["topk_method"] == "noaux_tc" and c["scoring_func"] == "sigmoid" and c["ep_size"] == 1
        for c in (written_config, plain))
    moved = tmp_path / "moved"
    (tmp_path / "hf").rename(moved)  # the checkpoint it came from is gone: published has nothing to write as
    assert main(["convert", "to-hf", str(step), str(tmp_path / "again"), "--dtype=published", "--mtp=drop"]) == 2
