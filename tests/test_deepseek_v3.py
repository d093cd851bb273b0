"""deepseek_v3 against transformers' DeepseekV3ForCausalLM: the same logits from the same weights
(copied by name, independently of the HF mapping, and through `load_hf` / `save_hf`), over
shapes with and without a q LoRA, odd head counts, interleaved and half-split RoPE, YaRN with the
softmax mscale, attention biases and group-limited routing; and the full mop layout against the
single-process reference."""

import dataclasses

import pytest
import torch

from mop.models.hf import config_from_hf, load_hf, save_hf
from mop.models.transformer import build_model
from test_hf import SIGMOID_ROUTER_TO_MOP, batch, copy_weights_by_name, randomize, randomize_score_correction_bias

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def hf_config(**overrides):
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                    n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                    norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0)
    settings.update(overrides)
    if "num_attention_heads" in overrides:
        settings["num_key_value_heads"] = overrides["num_attention_heads"]
    return transformers.DeepseekV3Config(**settings)


def random_hf_model(config, seed=0):
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(hf, seed, ".mlp.gate.weight")
    randomize_score_correction_bias(hf, seed + 7)
    return hf


CASES = {
    "q-lora+interleave+groups": {},
    "no-q-lora+half-split+odd-heads": dict(q_lora_rank=None, rope_interleave=False, num_attention_heads=3, n_group=1),
    "yarn+bias+4-groups-of-2": dict(rope_parameters=YARN, attention_bias=True, n_group=4, topk_group=2,
                                    norm_topk_prob=False, routed_scaling_factor=1.0),
    "yarn-truncate-off+top-3": dict(rope_parameters={**YARN, "truncate": False, "mscale_all_dim": 0.0},
                                    num_experts_per_tok=3, topk_group=2, n_shared_experts=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case):
    config = hf_config(**CASES[case])
    hf = random_hf_model(config)
    mop = build_model(config_from_hf(config.to_dict()), seed=0)
    copy_weights_by_name(hf, mop, SIGMOID_ROUTER_TO_MOP)
    with torch.no_grad():
        input_ids = batch(2)
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["q-lora+interleave+groups", "yarn+bias+4-groups-of-2"])
def test_load_hf_and_save_hf_round_trip_through_transformers(tmp_path, case):
    hf = random_hf_model(hf_config(**CASES[case]), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    mop = load_hf(tmp_path / "hf")
    input_ids = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)
    save_hf(mop, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert again.config.q_lora_rank == hf.config.q_lora_rank and again.config.rope_parameters == hf.config.rope_parameters
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids).logits, hf(input_ids).logits, atol=1e-5, rtol=0)


def test_a_kimi_k2_folder_reads_as_deepseek_v3(tmp_path):
    import json

    hf = random_hf_model(hf_config())
    hf.save_pretrained(tmp_path / "kimi")
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    mop = load_hf(tmp_path / "kimi")
    assert mop.cfg.family == "deepseek_v3"
    with torch.no_grad():
        torch.testing.assert_close(mop(batch(1)), hf(batch(1)).logits, atol=1e-5, rtol=0)


DEEPSEEK_RUN = ["--model.family=deepseek_v3", "--model.heads=4", "--model.kv_heads=4", "--model.head_dim=12",
                "--model.options.qk_rope_head_dim=4", "--model.options.kv_lora_rank=16", "--model.options.q_lora_rank=8",
                "--model.options.v_head_dim=8", "--model.options.groups=2", "--model.options.routed_scaling_factor=2.5",
                "--model.options.yarn_factor=4", "--model.options.yarn_original_context=8",
                "--model.options.yarn_mscale=1", "--model.options.yarn_mscale_all_dim=1",
                "--model.shared_expert_intermediate=32", "--model.dense_layers=1", "--model.layers=3",
                "--model.aux_loss_coef=0.001", "--model.options.router_bias_update_rate=0.05"]


@pytest.mark.slow
def test_every_technique_on_four_ranks_trains_like_the_reference(tmp_path):
    """Ulysses over the latent attention's heads (D = 4), LLEP forced to spill in two chunks over 4
    expert ranks, the vocabulary ring over 4, block checkpointing with offload and the host optimizer."""
    from test_train import losses, run

    reference = run(tmp_path, "reference", *DEEPSEEK_RUN)
    records = run(tmp_path, "all", *DEEPSEEK_RUN, "--parallel.strategy=mop", "--parallel.nproc=4",
                  "--parallel.sequence=4", "--parallel.expert=4", "--parallel.vocab=4",
                  "--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4", "--parallel.llep_gate=1.0",
                  "--parallel.llep_alpha=0.5", "--parallel.llep_chunks=2", "--train.activation_checkpointing=full",
                  "--train.offload_activations=true", "--optim.offload=true")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)
    assert sum(r["llep_active"] for r in records) > 0  # the spill ran


def quantize_fp8(folder, block) -> dict:
    """The test's own small quantizer: every linear weight but the embedding, the head and the
    routers becomes fp8 e4m3 with one fp32 scale per `block` (amax / 448), written in place with
    the config's `quantization_config`; returns what its dequantization gives for each of them."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    dequantized = {}
    for key, weight in list(tensors.items()):
        if weight.dim() != 2 or any(part in key for part in ("embed_tokens", "lm_head", "mlp.gate.")):
            continue
        (rows, columns), (bo, bi) = weight.shape, block
        padded = torch.nn.functional.pad(weight.float(), (0, -columns % bi, 0, -rows % bo))
        blocks = padded.unflatten(0, (-1, bo)).unflatten(2, (-1, bi))  # [R, bo, C, bi]
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
        fp8 = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :columns].to(torch.float8_e4m3fn)
        tensors[key], tensors[key + "_scale_inv"] = fp8, scale
        dequantized[key] = fp8.float() * scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :columns]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def test_fp8_block_scaled_checkpoints_load_dequantized_row_block_by_row_block(tmp_path):
    """A checkpoint as DeepSeek-V3 and Kimi-K2 publish it (fp8 e4m3, block scales; blocks of 16 x 8
    here, so that weights span several blocks and end in partial ones) loads to the logits that
    transformers computes on the weights this test dequantized itself; a shard's rows that start
    and end inside blocks dequantize alone to the same values."""
    from safetensors.torch import load_file, save_file

    from mop.models.hf import HFWeights

    hf = random_hf_model(hf_config(num_nextn_predict_layers=0))
    hf.save_pretrained(tmp_path / "fp8")
    hf.save_pretrained(tmp_path / "dequantized")
    dequantized = quantize_fp8(tmp_path / "fp8", (16, 8))
    reference_weights = load_file(tmp_path / "dequantized" / "model.safetensors")
    save_file({**reference_weights, **dequantized}, tmp_path / "dequantized" / "model.safetensors",
              metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", attn_implementation="eager")
    mop = load_hf(tmp_path / "fp8")
    with torch.no_grad():
        torch.testing.assert_close(mop(batch(2)), reference(batch(2)).logits, atol=1e-5, rtol=0)
    with HFWeights(tmp_path / "fp8") as weights:
        name = "layers.1.attention.kv_b_proj.weight"  # [heads x (nope + v) = 112, 32]: 7 row blocks
        full = dict(mop.named_parameters())[name]
        torch.testing.assert_close(weights.rows(name, full.shape, 5, 30), full[5:35].detach(), atol=0, rtol=0)
        assert any(scale.endswith("_scale_inv") for _, scale, _ in weights.quantized.companions.values())


def test_an_unsupported_quantization_is_one_line(tmp_path):
    import json

    from mop.models.hf import HFConversionError

    random_hf_model(hf_config()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match="quant_method='compressed-tensors' is not supported"):
        load_hf(tmp_path / "hf")


def test_auxiliary_loss_free_balancing_moves_each_layers_bias_against_its_load():
    """bias += rate x sign(mean load - load) per MoE layer; a rate of 0 leaves it frozen; the counts
    the trainer sums come from the forward, one row per MoE layer."""
    from mop.models.config import ModelConfig

    cfg = ModelConfig(family="deepseek_v3", hidden=32, layers=3, heads=2, kv_heads=2, head_dim=12, experts=4,
                      dense_layers=1, options={"qk_rope_head_dim": 4, "kv_lora_rank": 8, "v_head_dim": 8,
                                               "router_bias_update_rate": 0.1})
    model = build_model(cfg, seed=0)
    terms = model.loss_terms(batch(2) % 259, batch(2, seed=2) % 259)
    counts = terms.expert_stats[:, :-1]  # the last column: the summed router entropy
    assert counts.shape == (2, 4) and counts.sum() == 2 * 2 * 24 * cfg.top_k
    model.update_router_biases(torch.tensor([[1.0, 2.0, 4.0, 5.0], [3.0, 3.0, 3.0, 3.0]]))
    biases = [b for name, b in model.named_buffers() if name.endswith("score_correction_bias")]
    assert torch.equal(biases[0], torch.tensor([0.1, 0.1, -0.1, -0.1])) and torch.equal(biases[1], torch.zeros(4))
    frozen = build_model(dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, router_bias_update_rate=0.0)), 0)
    assert not frozen.balances_router_biases and model.balances_router_biases


@pytest.mark.slow
def test_bf16_in_the_mop_layout_stays_within_the_bf16_tolerance_of_the_bf16_reference(tmp_path):
    """bf16 working weights with fp32 host masters on both sides; a layout changes only the order of
    fp32 sums and where partial sums round to bf16: losses and gradient norms within 2^-8 relative
    (the bound `tests/test_layouts.py` states)."""
    from test_layouts import check_bf16_mop_layout_against_the_bf16_reference

    check_bf16_mop_layout_against_the_bf16_reference(tmp_path, DEEPSEEK_RUN, [
        "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
        "--parallel.expert_balance=llep", "--train.activation_checkpointing=full"])


def test_exports_keep_the_source_configs_keys_and_the_router_it_implies():
    """config.json as an engine reads it (issue 63): every key of the checkpoint the weights came from that mop
    does not write itself is kept (vLLM builds DeepSeek-V3's router from `topk_method` and `scoring_func`,
    `deepseek_v2.py`), but for its quantization_config and pad id; with no source, the router mop's
    deepseek_v3 is; a checkpoint of another router is refused in one line."""
    from mop.models.hf import HFConversionError, config_from_hf, config_to_hf

    source = {**hf_config().to_dict(), "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1,
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "pad_token_id": 3,
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    cfg = config_from_hf(source)
    written = config_to_hf(cfg, source=source)
    assert {key: written[key] for key in ("ep_size", "auto_map", "topk_method")} == {
        key: source[key] for key in ("ep_size", "auto_map", "topk_method")}
    assert "quantization_config" not in written and "pad_token_id" not in written
    assert written["n_routed_experts"] == cfg.experts and config_from_hf(written) == cfg
    bare = config_to_hf(cfg)
    assert (bare["topk_method"], bare["scoring_func"]) == ("noaux_tc", "sigmoid")
    with pytest.raises(HFConversionError, match=r"^config.json: scoring_func='softmax'; mop's deepseek_v3 router is"):
        config_from_hf({**source, "scoring_func": "softmax"})
