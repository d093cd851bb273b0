"""glm4_moe against transformers' Glm4MoeForCausalLM: the same logits from the same weights (copied by
name, independently of the HF mapping, and through `load_hf` / `save_hf`)."""

import pytest
import torch

from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from test_hf import SIGMOID_ROUTER_TO_MOP, batch, copy_weights_by_name, randomize, randomize_score_correction_bias

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("bias, qk_norm, groups, groups_per_token, scaling", [
    (True, True, 2, 1, 2.5), (False, False, 1, 1, 1.0), (True, False, 4, 2, 1.5)])
def test_logits_equal_transformers(bias, qk_norm, groups, groups_per_token, scaling):
    hf_config = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=groups, topk_group=groups_per_token, routed_scaling_factor=scaling,
        first_k_dense_replace=1, norm_topk_prob=True, attention_bias=bias, use_qk_norm=qk_norm,
        partial_rotary_factor=0.5)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    randomize(hf, 0, ".mlp.gate.weight")
    randomize_score_correction_bias(hf, 7)
    cfg = ModelConfig(family="glm4_moe", vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16,
                      qk_norm=qk_norm, norm_eps=hf_config.rms_norm_eps, rope_theta=hf_config.rope_parameters["rope_theta"],
                      experts=8, top_k=2, expert_intermediate=32, shared_expert_intermediate=32, dense_layers=1,
                      dense_intermediate=96, norm_topk_prob=True,
                      options={"attention_bias": bias, "partial_rotary_factor": 0.5, "groups": groups,
                               "groups_per_token": groups_per_token, "routed_scaling_factor": scaling})
    mop = build_model(cfg, seed=0)
    copy_weights_by_name(hf, mop, SIGMOID_ROUTER_TO_MOP)
    with torch.no_grad():
        input_ids = batch(2)
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)


def test_load_hf_and_save_hf_round_trip_through_transformers(tmp_path):
    from mop.models.hf import load_hf, save_hf

    hf_config = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    randomize(hf, 0, ".mlp.gate.weight")
    randomize_score_correction_bias(hf, 3)
    hf.save_pretrained(tmp_path / "hf")
    mop = load_hf(tmp_path / "hf")
    assert mop.cfg.options.routed_scaling_factor == 2.5 and mop.cfg.shared_expert_intermediate == 64
    input_ids = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)
    save_hf(mop, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids).logits, hf(input_ids).logits, atol=1e-5, rtol=0)


def test_a_checkpoint_keeps_the_score_correction_bias_and_bf16_storage_keeps_it_fp32(tmp_path):
    from mop import checkpoint
    from mop.config import Config
    from mop.data.tokenizer import ByteTokenizer
    from mop.optim.optimizer import DeviceAdamW

    def tiny():
        cfg = ModelConfig(family="glm4_moe", vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8,
                          experts=4, expert_intermediate=8, options={"groups": 2})
        model = build_model(cfg, seed=0)
        return model, DeviceAdamW(torch.optim.AdamW(model.parameters()), model, None, torch.device("cpu"), {})

    model, optimizer = tiny()
    (bias,) = [b for n, b in model.named_buffers() if n.endswith("score_correction_bias")]
    bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    checkpoint.save(tmp_path, 1, model, optimizer, checkpoint.GlobalViews(model, None), {"position": 0}, Config(), 1,
                    ByteTokenizer())
    fresh, fresh_optimizer = tiny()
    checkpoint.load(tmp_path / "step_1", fresh, fresh_optimizer, checkpoint.GlobalViews(fresh, None))
    assert torch.equal(dict(fresh.named_buffers())["layers.0.mlp.router.score_correction_bias"], bias)

    with torch.device("meta"):
        from mop.models.transformer import MoETransformer

        stored = MoETransformer(model.cfg).cast_parameters(torch.bfloat16)
    assert stored.embed.weight.dtype == torch.bfloat16
    assert dict(stored.named_buffers())["layers.0.mlp.router.score_correction_bias"].dtype == torch.float32


GLM_RUN = ["--model.family=glm4_moe", "--model.options.attention_bias=true", "--model.options.groups=2",
           "--model.options.routed_scaling_factor=2.5", "--model.shared_expert_intermediate=32",
           "--model.dense_layers=1", "--model.layers=3", "--model.aux_loss_coef=0"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, offload", [(2, "false"), (4, "true")])
def test_every_technique_at_once_trains_like_the_reference(tmp_path, ranks, offload):
    from test_train import losses, run

    model = ["--model.heads=4", "--model.kv_heads=2", "--model.options.router_bias_update_rate=0.05"]
    reference = run(tmp_path, "reference", *GLM_RUN, *model)
    records = run(tmp_path, "all", *GLM_RUN, *model, "--parallel.strategy=mop",
                  f"--parallel.nproc={ranks}", f"--parallel.sequence={ranks}", f"--parallel.expert={ranks}",
                  f"--parallel.vocab={ranks}", "--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4",
                  "--parallel.llep_gate=1.0", "--parallel.llep_chunks=2", "--train.activation_checkpointing=full",
                  "--train.offload_activations=true", f"--optim.offload={offload}")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


@pytest.mark.slow
def test_bf16_in_the_mop_layout_stays_within_the_bf16_tolerance_of_the_bf16_reference(tmp_path):
    """As deepseek_v3's: losses and gradient norms within 2^-8 relative of the bf16 reference."""
    from test_layouts import check_bf16_mop_layout_against_the_bf16_reference

    check_bf16_mop_layout_against_the_bf16_reference(tmp_path, GLM_RUN, [
        "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
        "--parallel.expert_balance=llep", "--train.activation_checkpointing=full"])
