"""deepseek_v3 against transformers' DeepseekV3ForCausalLM: the same logits from the same weights
(copied by name, independently of the HF mapping, and through `load_hf` / `save_hf`), over
shapes with and without a q LoRA, odd head counts, interleaved and half-split RoPE, YaRN with the
softmax mscale, attention biases and group-limited routing; and the full mop layout against the
single-process reference."""

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
                "--model.aux_loss_coef=0.001"]


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
