"""HF conversion: parity with transformers (logits, loss, aux loss, every gradient), both on-disk
expert layouts, sharded checkpoints, save -> transformers / load round trips, and the errors.

The name maps below are written independently of `mop.models.hf`, so they check its mapping.
"""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mop.models.config import ModelConfig
from mop.models.hf import HFConversionError, config_from_hf, config_to_hf, load_hf, save_hf
from mop.models.moe import load_balancing_loss
from mop.models.transformer import IGNORE_INDEX, build_model

transformers = pytest.importorskip("transformers")

SEQ = 24
# transformers 5.x in-memory parameter names (stacked experts) -> mop names, applied in order.
HF_TO_MOP = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.norm\.", "norm."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
    (r"\.self_attn\.", ".attention."),
    (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
    (r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w_gate_up"),
    (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w_down"),
    (r"^model\.layers\.", "layers."),
]

HF_CASES = {
    # dense first layer, head_dim != hidden / heads, GQA, renormalised top-k, qk norm
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        router_aux_loss_coef=0.3),
    # raw top-k probabilities, tied embeddings, default head_dim, top-3
    "qwen3_moe_raw_topk_tied": lambda: transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
        tie_word_embeddings=True, rms_norm_eps=1e-5, router_aux_loss_coef=0.3),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.3),
}


SIGMOID_ROUTER_TO_MOP = [(r"\.mlp\.shared_experts\.", ".mlp.shared."),
                         (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.router.score_correction_bias"), *HF_TO_MOP]


@torch.no_grad()
def copy_weights_by_name(hf, mop, renames) -> None:
    """Every parameter and buffer of `mop` from the `hf` tensor `renames` maps to its name; each of
    hf's tensors but RoPE's inverse-frequency tables is used."""
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    mine = {**dict(mop.named_parameters()), **dict(mop.named_buffers())}
    renamed = {}
    for name, tensor in theirs.items():
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    assert set(mine) == {n for n in renamed if not n.endswith("inv_freq")}
    for name, tensor in mine.items():
        tensor.copy_(renamed[name])


@torch.no_grad()
def randomize_score_correction_bias(hf, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, buffer in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def mop_name(hf_name):
    for pattern, replacement in HF_TO_MOP:
        hf_name = re.sub(pattern, replacement, hf_name)
    return hf_name


@torch.no_grad()
def randomize(model, seed, router_suffix):
    """O(1) activations, norms away from one, and routers wide enough that top-k picks vary by token."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.dim() == 1:
            param.copy_(1 + 0.2 * noise)
        elif name.endswith(router_suffix):
            param.copy_(noise * 2 / param.shape[-1] ** 0.5)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)


def hf_model(case, seed=0):
    model = transformers.AutoModelForCausalLM.from_config(HF_CASES[case](), attn_implementation="eager")
    randomize(model, seed, ".mlp.gate.weight")
    return model


def batch(rows, seed=1):
    return torch.randint(0, 128, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def check_routing_is_unambiguous(router_logits, top_k):
    """Top-k picks varied across tokens and far from ties: the implementations differ by ~1e-7 in
    fp32, so a k-th/(k+1)-th probability gap of 1e-5 cannot flip a pick."""
    for logits in router_logits:
        probs = logits.softmax(-1).sort(-1, descending=True).values
        assert (probs[:, top_k - 1] - probs[:, top_k]).min() > 1e-5
        assert logits.topk(top_k).indices.unique().numel() > top_k


def check_parity(hf, mop, input_ids, labels, aux):
    """Loss (with or without aux loss) and every gradient, HF against mop."""
    hf.zero_grad()
    mop.zero_grad()
    out = hf(input_ids, labels=labels, output_router_logits=aux)
    loss = mop(input_ids, shifted(labels))
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    loss.backward()
    mop_params = dict(mop.named_parameters())
    for name, param in hf.named_parameters():
        torch.testing.assert_close(mop_params[mop_name(name)].grad, param.grad, atol=1e-5, rtol=0, msg=name)
    return out


@pytest.mark.parametrize("case", HF_CASES)
def test_load_hf_matches_transformers(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    mop = load_hf(tmp_path)
    assert {mop_name(n) for n, _ in hf.named_parameters()} == {n for n, _ in mop.named_parameters()}
    cfg = mop.cfg
    assert cfg.tie_embeddings == (mop.lm_head.weight is mop.embed.weight)
    # Settings too small to show in a 1e-5 comparison of outputs.
    assert (cfg.norm_eps, cfg.rope_theta) == (hf.config.rms_norm_eps, hf.config.rope_parameters["rope_theta"])
    assert cfg.aux_loss_coef == hf.config.router_aux_loss_coef == 0.3

    input_ids = batch(2)
    with torch.no_grad():
        out = hf(input_ids, output_router_logits=True)
        torch.testing.assert_close(mop(input_ids), out.logits, atol=1e-5, rtol=0)
    check_routing_is_unambiguous(out.router_logits, mop.cfg.top_k)

    labels = input_ids.clone()
    labels[0, :5] = IGNORE_INDEX
    mop.cfg = dataclasses.replace(cfg, aux_loss_coef=0.0)
    check_parity(hf, mop, input_ids, labels, aux=False)
    # HF pools the load-balancing loss over the whole batch, mop per sequence: equal for one row.
    mop.cfg = cfg
    out = check_parity(hf, mop, input_ids[:1], labels[:1], aux=True)
    with torch.no_grad():
        terms = mop.loss_terms(input_ids[:1], shifted(labels[:1]))
    torch.testing.assert_close(load_balancing_loss(terms.router), out.aux_loss, atol=1e-6, rtol=0)


def per_expert_hub_layout(state, model_type):
    """The stacked in-memory tensors renamed by hand to the hub's per-expert keys."""
    moe, names = ("block_sparse_moe", ("w1", "w3", "w2")) if model_type == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    out = {}
    for key, tensor in state.items():
        match = re.match(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$", key)
        if match is None:
            out[key] = tensor
            continue
        prefix, what = match.groups()
        if what == "gate.weight":
            out[f"{prefix}{moe}.gate.weight"] = tensor
            continue
        for e, expert in enumerate(tensor):
            parts = zip(names[:2], expert.chunk(2)) if what == "experts.gate_up_proj" else [(names[2], expert)]
            for name, part in parts:
                out[f"{prefix}{moe}.experts.{e}.{name}.weight"] = part.clone()
    return out


def write_sharded(tensors, directory, shards=2):
    keys = sorted(tensors)
    weight_map = {}
    for n in range(shards):
        name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[n::shards]
        save_file({k: tensors[k].contiguous() for k in part}, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("case", HF_CASES)
def test_load_hf_reads_stacked_and_per_expert_layouts(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "saved")
    state = {k: v for k, v in hf.state_dict().items() if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    stacked, hub = tmp_path / "stacked", tmp_path / "hub"
    for directory in (stacked, hub):
        directory.mkdir()
        shutil.copy(tmp_path / "saved" / "config.json", directory)
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    write_sharded(per_expert_hub_layout(state, hf.config.model_type), hub)

    reference = load_hf(tmp_path / "saved").state_dict()
    for directory in (stacked, hub):
        loaded = load_hf(directory).state_dict()
        assert loaded.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(loaded[name], tensor), (directory.name, name)


MOP_CASES = {
    "qwen3_moe": ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=24, experts=8,
                             top_k=2, expert_intermediate=48, dense_layers=1, dense_intermediate=80,
                             norm_topk_prob=False, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-5),
    "mixtral": ModelConfig(family="mixtral", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                           expert_intermediate=32, qk_norm=False, aux_loss_coef=0.02),
}


def mop_model(case):
    model = build_model(MOP_CASES[case], seed=0)
    randomize(model, 3, "router.weight")
    return model


def check_round_trip(model, directory, dtype=torch.float32):
    loaded = load_hf(directory, dtype=dtype)
    assert loaded.cfg == model.cfg
    state = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor.to(dtype)), name


@pytest.mark.parametrize("case", MOP_CASES)
def test_save_hf_loads_in_transformers_and_round_trips(case, tmp_path):
    model = mop_model(case)
    save_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == case
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    input_ids = batch(2, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)
    check_round_trip(model, tmp_path)


def test_save_hf_shards_and_casts(tmp_path):
    model = mop_model("mixtral")
    save_hf(model, tmp_path, max_shard_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    check_round_trip(model, tmp_path)

    save_hf(model, tmp_path, dtype=torch.bfloat16)  # also replaces the shards of the previous save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    check_round_trip(model, tmp_path, dtype=torch.bfloat16)


BASE = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2}


def test_config_from_hf_reads_old_and_new_keys():
    old = config_from_hf({**BASE, "rope_theta": 123.0, "rope_scaling": None, "mlp_only_layers": [0, 1]})
    new = config_from_hf({**{k: v for k, v in BASE.items() if k != "num_experts"}, "num_local_experts": 4,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}, "mlp_only_layers": [0, 1]})
    assert old == new
    assert (old.rope_theta, old.dense_layers, old.dense_intermediate, old.head_dim, old.experts) == (123.0, 2, 96, 16, 4)
    assert not old.norm_topk_prob and old.qk_norm
    assert config_from_hf({**BASE, "decoder_sparse_step": 2, "num_hidden_layers": 1}).dense_layers == 1


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"num_key_value_heads": 3}, "kv_heads"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
])
def test_config_from_hf_rejects(change, message):
    with pytest.raises(HFConversionError, match=re.escape(message)):
        config_from_hf({**BASE, **change})


def test_mixtral_sliding_window_and_config_expressibility():
    with pytest.raises(HFConversionError, match="sliding_window"):
        config_from_hf({**BASE, "model_type": "mixtral", "num_local_experts": 4, "sliding_window": 4096})
    cfg = MOP_CASES["qwen3_moe"]
    with pytest.raises(HFConversionError, match="qk_norm=true"):
        config_to_hf(cfg, "mixtral")
    with pytest.raises(HFConversionError, match="qk_norm=false"):
        config_to_hf(MOP_CASES["mixtral"], "qwen3_moe")
    with pytest.raises(HFConversionError, match="norm_topk_prob=false"):
        config_to_hf(dataclasses.replace(MOP_CASES["mixtral"], norm_topk_prob=False))


def test_load_and_save_errors(tmp_path):
    with pytest.raises(HFConversionError, match="config.json: not found"):
        load_hf(tmp_path)
    model = mop_model("mixtral")
    save_hf(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    broken = [
        ({k: v for k, v in tensors.items() if k != key}, f"lacks 1 tensor(s) config.json implies, e.g. {key}"),
        ({**tensors, "model.layers.2.input_layernorm.weight": torch.ones(64)}, "model.layers.2.input_layernorm"),
        ({**tensors, key: torch.zeros(64, 31)}, f"{key} has shape [64, 31] but config.json implies [64, 32]"),
    ]
    for bad, message in broken:
        save_file(bad, weights)
        with pytest.raises(HFConversionError, match=re.escape(message)):
            load_hf(tmp_path)
    weights.unlink()
    with pytest.raises(HFConversionError, match="no model.safetensors"):
        load_hf(tmp_path)

    shared = build_model(dataclasses.replace(MOP_CASES["qwen3_moe"], shared_expert_intermediate=32), seed=0)
    with pytest.raises(HFConversionError, match="shared_expert_intermediate=32"):
        save_hf(shared, tmp_path / "shared")
    assert not (tmp_path / "shared").exists()
