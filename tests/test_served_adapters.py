"""The adapters serving engines load (`mop.models.served_adapters`), for every family.

Oracles: PEFT on transformers' model (the fused adapter it loads), and this file's own reading of
the engines' documented layout (vLLM 0.33's `lora/utils.py`, `lora_weights.py`, `model_manager.py`;
SGLang 0.5.23's `lora/utils.py`, `lora.py`): keys `base_model.model.<module>.lora_{A,B}.weight`;
per-expert modules `model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj` (Mixtral's
`block_sparse_moe.experts.{e}.{w1,w3,w2}`) with A `(r, in)`, B `(out, r)` and every expert of an
adapted layer holding all three; gpt-oss's fused 3D form read as vLLM splits it (A reshaped to
`(E, r, in)`, B to `(out, r, E)` then expert-first). The weights that reading merges give
transformers PEFT's logits, and expert by expert the adapters equal PEFT's fused ones.
"""

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from test_hf import HF_CASES, batch, randomize, randomize_score_correction_bias
from test_lora import randomize_adapters

from mop.models.hf import config_from_hf, load_hf
from mop.models.lora import LoraConfig
from mop.models.peft import from_peft
from mop.models.served_adapters import save_adapters, serving_warnings
from mop.models.transformer import build_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EVERY_KIND = "attention,dense_mlp,shared_experts,routed_experts"
PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj"
                        r"|w1|w3|w2)$")
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# What SGLang's target_modules normalisation maps (its lora/utils.py); vLLM follows the keys.
SGLANG_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                  "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


def glm4_config():
    return transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, partial_rotary_factor=0.5)


def hf_models():
    import test_deepseek_v3
    import test_gpt_oss

    return {"qwen3_moe": HF_CASES["qwen3_moe"], "mixtral": HF_CASES["mixtral"], "glm4_moe": glm4_config,
            "deepseek_v3": test_deepseek_v3.hf_config, "gpt_oss": test_gpt_oss.hf_config}


def random_hf(family):
    hf = transformers.AutoModelForCausalLM.from_config(hf_models()[family](), attn_implementation="eager")
    randomize(hf, 0, ".mlp.router.weight" if family == "gpt_oss" else ".mlp.gate.weight")
    if family in ("deepseek_v3", "glm4_moe"):
        randomize_score_correction_bias(hf, 7)
    return hf.eval()


def engine_merged(state: dict, folder, hf_config) -> dict:
    """The base `state` (transformers' in-memory names) with the engine folder's adapters merged in,
    read as the engines document them (module docstring); checks their names and shapes on the way."""
    config = json.loads((folder / "adapter_config.json").read_text())
    assert "target_parameters" not in config and set(config["target_modules"]) <= SGLANG_TARGETS, config
    scaling, rank = config["lora_alpha"] / config["r"], config["r"]
    tensors = load_file(folder / "adapter_model.safetensors")
    modules = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        assert match is not None, f"{key}: not a key the engines parse"
        modules.setdefault(match[1], {})[match[2]] = tensor.float()
    state = {key: value.clone() for key, value in state.items()}
    hidden, inter = hf_config.hidden_size, getattr(hf_config, "moe_intermediate_size", hf_config.intermediate_size)
    per_expert = {}
    for module, ab in modules.items():
        a, b = ab["A"], ab["B"]
        expert = PER_EXPERT.fullmatch(module)
        if expert is not None:
            layer, e, name = int(expert[1]), int(expert[2]), MIXTRAL_NAMES.get(expert[3], expert[3])
            per_expert.setdefault(layer, {}).setdefault(e, set()).add(name)
            fan_in, fan_out = (inter, hidden) if name == "down_proj" else (hidden, inter)
            assert a.shape == (rank, fan_in) and b.shape == (fan_out, rank), (module, a.shape, b.shape)
            prefix = f"model.layers.{layer}.mlp.experts."
            delta = scaling * b @ a
            if name == "down_proj":
                state[prefix + "down_proj"][e] += delta
            else:
                rows = slice(0, inter) if name == "gate_proj" else slice(inter, 2 * inter)
                state[prefix + "gate_up_proj"][e, rows] += delta
        elif module.endswith((".experts", ".experts.base_layer")):  # gpt-oss: vLLM's 3D form
            experts = hf_config.num_local_experts
            weight = module.removesuffix(".base_layer") + (".gate_up_proj" if module.endswith("base_layer")
                                                            else ".down_proj")
            a_e = a.reshape(experts, rank, a.shape[-1])
            b_e = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
            state[weight] += scaling * (b_e @ a_e).transpose(-1, -2)  # stored [E, in, out]
        else:
            state[module + ".weight"] += scaling * b @ a
    for layer, experts in per_expert.items():  # vLLM: every expert of an adapted layer, all three projections
        assert len(experts) == getattr(hf_config, "n_routed_experts", getattr(hf_config, "num_local_experts", None)
                                       or getattr(hf_config, "num_experts", None))
        assert all(names == {"gate_proj", "up_proj", "down_proj"} for names in experts.values()), layer
    return state


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_the_engines_layout_computes_pefts_function_and_splits_its_experts_exactly(tmp_path, family):
    hf = random_hf(family)
    hf.save_pretrained(tmp_path / "base")
    cfg = config_from_hf(hf.config.to_dict())
    lora = LoraConfig(rank=4, alpha=8, targets=EVERY_KIND)
    mop = build_model(cfg, 0, lora=lora)
    mop.load_state_dict(load_hf(tmp_path / "base").state_dict(), strict=False)
    adapters = randomize_adapters(mop)
    save_adapters(tmp_path / "adapter", cfg, lora, adapters)
    ids = batch(2)

    served = copy.deepcopy(hf)
    served.load_state_dict(engine_merged(hf.state_dict(), tmp_path / "adapter" / "serve", hf.config))
    with torch.no_grad():
        engines = served(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")(input_ids=ids).logits
        ours = mop(ids)
    torch.testing.assert_close(engines, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)

    fused = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    served_tensors = load_file(tmp_path / "adapter" / "serve" / "adapter_model.safetensors")
    if family == "gpt_oss":  # vLLM reads PEFT's fused form itself
        assert served_tensors.keys() == fused.keys()
        assert all(torch.equal(served_tensors[key], fused[key]) for key in fused)
        return
    layer = cfg.dense_layers  # the first MoE layer, expert by expert against PEFT's fused adapter
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    peft_base = f"base_model.model.model.layers.{layer}.mlp.experts."
    gate_up_a = from_peft("lora_A", fused[peft_base + "base_layer.lora_A.weight"], cfg.experts)
    gate_up_b = from_peft("lora_B", fused[peft_base + "base_layer.lora_B.weight"], cfg.experts)
    down_a = from_peft("lora_A", fused[peft_base + "lora_A.weight"], cfg.experts)
    down_b = from_peft("lora_B", fused[peft_base + "lora_B.weight"], cfg.experts)
    for e in range(cfg.experts):
        key = f"base_model.model.model.layers.{layer}.{moe}.experts.{e}.{{}}.lora_{{}}.weight".format
        assert torch.equal(served_tensors[key(gate, "A")], gate_up_a[e])
        assert torch.equal(served_tensors[key(up, "A")], gate_up_a[e])
        assert torch.equal(torch.cat([served_tensors[key(gate, "B")], served_tensors[key(up, "B")]]), gate_up_b[e])
        assert torch.equal(served_tensors[key(down, "A")], down_a[e])
        assert torch.equal(served_tensors[key(down, "B")], down_b[e])


def test_an_adapter_vllm_drops_is_warned_of():
    deepseek = config_from_hf(hf_models()["deepseek_v3"]().to_dict())
    assert serving_warnings(deepseek, LoraConfig(targets="q_a_proj,q_b_proj,o_proj,experts")) == []
    (warning,) = serving_warnings(deepseek, LoraConfig(targets="attention"))
    assert "kv_b_proj" in warning and "48974" in warning


def test_adapters_sglang_fails_on_or_drops_are_warned_of():
    """What SGLang 0.5.23 does with these adapters, as its code reads (issue 63): a latent attention
    without a low-rank query (`q_lora_rank` 0) has a plain q_proj, whose adapter SGLang's qkv
    normalisation fails on (`srt/lora/lora.py:283-293`: `weights[v_name]` of a model with no v_proj), and
    kv_a_proj_with_mqa is adapted only fused with q_a_proj (`lora.py:503-528`, `utils.py:312-313`); its
    shared-experts fusion, on by default on GPUs for GLM-4.5 and for DeepSeek-V3 of 256 or 384 routed
    experts and one shared (`srt/models/deepseek_v2.py:3357-3374`, `glm4_moe.py:1012-1030`), builds no
    shared_experts module, and their adapters are skipped without a word (`srt/lora/mem_pool.py:1146-1148`)."""
    import dataclasses

    deepseek = config_from_hf(hf_models()["deepseek_v3"]().to_dict())
    plain_query = dataclasses.replace(deepseek, options=dataclasses.replace(deepseek.options, q_lora_rank=0))
    warnings = serving_warnings(plain_query, LoraConfig(targets="attention"))
    assert len(warnings) == 2 and "q_proj and kv_a_proj_with_mqa" in warnings[1] and "lora.py:293" in warnings[1]
    assert serving_warnings(plain_query, LoraConfig(targets="kv_b_proj,o_proj,experts"))[1:] == []
    assert serving_warnings(deepseek, LoraConfig(targets="shared_experts")) == []  # its few experts: never fused
    published_shape = dataclasses.replace(deepseek, experts=256, top_k=8)
    (warning,) = serving_warnings(published_shape, LoraConfig(targets="shared_experts"))
    assert "--disable-shared-experts-fusion" in warning
    glm = config_from_hf(hf_models()["glm4_moe"]().to_dict())
    assert glm.shared_expert_intermediate and "--disable-shared-experts-fusion" in serving_warnings(
        glm, LoraConfig(targets="shared_experts"))[0]
    assert serving_warnings(glm, LoraConfig(targets="attention,routed_experts")) == []
