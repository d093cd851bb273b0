"""LoRA over a frozen base kept at its published precision (`mop.models.lora`, `mop.settle.adapters`, `mop.adapters`).

Oracles: PEFT on transformers' own models (the adapters mop writes load with
`PeftModel.from_pretrained` and give mop's logits and adapter gradients), the base model itself
(step 0), the single-process reference run (every layout), and the base dequantized by the tests'
own quantizers (an fp8- or MXFP4-stored base trains like the dequantized one).
"""

import json

import pytest
import torch
from test_hf import HF_CASES, batch, randomize, shifted
from test_train import TINY, losses

from mop.cli import main
from mop.metrics import read_metrics
from mop.models.config import ModelConfig
from mop.models.formats import Fp8Blocks
from mop.models.hf import config_from_hf, load_hf
from mop.models.lora import LoraConfig, stored_tensors
from mop.models.moe import swiglu_projected
from mop.models.projections import Adapted, Dense, Dequantized
from mop.models.transformer import IGNORE_INDEX, build_model

transformers = pytest.importorskip("transformers")

LORA = ["--train.finetune=lora", "--lora.rank=4", "--optim.lr=3e-2"]
# LLEP forced to spill (chunked), the ring, Ulysses, block checkpointing with offload, the host optimizer
EVERY_TECHNIQUE = ["--parallel.strategy=mop", "--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2",
                   "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0", "--parallel.llep_alpha=0.5",
                   "--parallel.llep_min_chunk=4", "--parallel.llep_chunks=2", "--train.activation_checkpointing=full",
                   "--train.offload_activations=true", "--optim.offload=true"]
FAMILY_RUNS = {
    "qwen3_moe": ["--model.heads=4", "--model.kv_heads=2"],
    "deepseek_v3": ["--model.family=deepseek_v3", "--model.heads=4", "--model.kv_heads=4", "--model.head_dim=12",
                    "--model.options.qk_rope_head_dim=4", "--model.options.kv_lora_rank=16",
                    "--model.options.q_lora_rank=8", "--model.options.v_head_dim=8", "--model.options.groups=2",
                    "--model.shared_expert_intermediate=32", "--model.dense_layers=1", "--model.layers=3"],
    "gpt_oss": ["--model.family=gpt_oss", "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8",
                "--model.qk_norm=false", "--model.options.sliding_window=5", "--model.layers=2"],
}


def run(tmp_path, name, *extra):
    assert main(["train", *TINY, f"--log.run_dir={tmp_path / name}", *extra]) == 0
    return read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference_of(tmp_path_factory):
    """`reference_of(*settings)`: the single-process reference run's records, made once per worker for each
    settings (a reference is deterministic, and every layout of a family compares with the same one)."""
    made = {}

    def reference(*settings):
        if settings not in made:
            made[settings] = run(tmp_path_factory.mktemp("reference"), "reference", *settings)
        return made[settings]

    return reference


def assert_same_run(records, reference):
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


# ---------------------------------------------------------------- the model


def small(family: str) -> ModelConfig:
    extra = {"deepseek_v3": dict(dense_layers=1, shared_expert_intermediate=32, layers=3,
                                 options={"groups": 2, "kv_lora_rank": 16, "q_lora_rank": 8}),
             "gpt_oss": dict(qk_norm=False)}.get(family, {})
    return ModelConfig(family=family, hidden=64, expert_intermediate=32, **extra)


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "none"), ("qwen3_moe", "fp8:16x8"), ("deepseek_v3", "fp8:8x16"),
                                         ("gpt_oss", "none"), ("gpt_oss", "mxfp4")])
def test_step_zero_computes_the_base_model(family, fmt):
    """B starts at zero (PEFT's initialisation): the adapted model's logits are the base model's, a
    quantized base's those of its dequantized weights."""
    cfg = small(family)
    adapted = build_model(cfg, seed=0, lora=LoraConfig(rank=4, base_format=fmt))
    base = build_model(cfg, seed=0)
    stored = {}  # weight name -> (its entry, its stored tensors in order)
    for name, entry in stored_tensors(adapted).items():
        stored.setdefault(entry.weight, (entry, {}))[1][entry.companion] = adapted.get_parameter(name)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name not in stored:
                param.copy_(adapted.get_parameter(name))
                continue
            entry, tensors = stored[name]
            weight = entry.fmt.dequantize(*(tensors[i] for i in sorted(tensors)), torch.float32)
            param.copy_(weight.transpose(1, 2) if entry.transposed else weight)
    assert stored or fmt == "none"
    ids = batch(2)
    torch.testing.assert_close(adapted(ids), base(ids), atol=1e-6, rtol=0)


def _stacked(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5


@pytest.mark.parametrize("quantized", [False, True])
def test_adapted_experts_grouped_and_looped_are_identical_and_equal_the_merged_weights(quantized):
    """An adapted projection is `W + scaling B_e A_e` for each expert (the merged weights, as PEFT
    computes it): the grouped GEMMs, the per-expert loop and the merged weights agree on outputs,
    the probe path and every gradient."""
    experts, hidden, inter, rank = 4, 16, 8, 4
    counts = [3, 0, 5, 2]
    fmt = Fp8Blocks((4, 8), (inter, inter))
    gate_up, down = _stacked(experts, 2 * inter, hidden, seed=1), _stacked(experts, hidden, inter, seed=2)
    if quantized:
        gate_up = fmt.dequantize(*fmt.quantize(gate_up), torch.float32)
    adapters = [_stacked(*shape, seed=3 + i).requires_grad_() for i, shape in enumerate(
        [(experts, rank, hidden), (experts, 2 * inter, rank), (experts, rank, inter), (experts, hidden, rank)])]
    x = _stacked(sum(counts), hidden, seed=9).requires_grad_()
    probe = _stacked(sum(counts), hidden, seed=10)

    def projections():
        base = Dequantized(fmt, fmt.quantize(gate_up), False, hidden, 2 * inter) if quantized else Dense(gate_up)
        return Adapted(base, adapters[0], adapters[1], 0.5), Adapted(Dense(down), adapters[2], adapters[3], 0.5)

    def merged():
        return (Dense(gate_up + 0.5 * adapters[1] @ adapters[0]), Dense(down + 0.5 * adapters[3] @ adapters[2]))

    results = []
    for build, grouped in ((projections, True), (projections, False), (merged, False)):
        out = swiglu_projected(x, counts, *build(), grouped=grouped)
        product = swiglu_projected(x, counts, *build(), grouped=grouped, probe=probe)
        grads = torch.autograd.grad(out.square().sum() + product.sum(), (x, *adapters))
        results.append((out, product, *grads))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(results[0], results[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_dequantized_projection_saves_only_its_stored_bytes_for_the_backward():
    """The widened weight of an fp8-stored projection is never kept for the backward (it is
    dequantized again there): every tensor autograd saves is smaller than it."""
    cfg = small("qwen3_moe")
    model = build_model(cfg, seed=0, lora=LoraConfig(rank=4, base_format="fp8:16x8"))
    widened = 2 * cfg.expert_intermediate * cfg.hidden * cfg.experts
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model(batch(2), labels=shifted(batch(2))).backward()
    assert saved and max(saved) < widened
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


# ---------------------------------------------------------------- PEFT


@torch.no_grad()
def randomize_adapters(model, seed=3) -> dict:
    """Every adapter of `model` set to N(0, 0.1) (B too, so that they change the function); returns them by name."""
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    generator = torch.Generator().manual_seed(seed)
    for p in adapters.values():
        p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return adapters


def peft_cases():
    import test_deepseek_v3
    import test_gpt_oss

    def qwen3():
        hf = transformers.AutoModelForCausalLM.from_config(HF_CASES["qwen3_moe"](), attn_implementation="eager")
        randomize(hf, 0, ".mlp.gate.weight")
        return hf

    return {"qwen3_moe": qwen3,  # a dense first layer
            "deepseek_v3": lambda: test_deepseek_v3.random_hf_model(test_deepseek_v3.hf_config()),
            "gpt_oss": lambda: test_gpt_oss.random_hf_model(test_gpt_oss.hf_config())}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("targets", ["attention,dense_mlp,shared_experts,routed_experts", "q_proj,experts"])
def test_peft_loads_the_adapters_mop_writes_and_computes_the_same_logits_and_gradients(tmp_path, family, targets):
    """transformers' model with PEFT's LoRA (parameter targeting for the fused experts), loaded by
    `PeftModel.from_pretrained` from what mop writes, gives mop's logits (fp32, 1e-5) and the same
    gradient for every adapter."""
    peft = pytest.importorskip("peft")
    from mop.models.peft import PREFIX, adapter_names, from_peft, save_peft

    hf = peft_cases()[family]()
    hf.save_pretrained(tmp_path / "base")
    cfg = config_from_hf(hf.config.to_dict())
    lora = LoraConfig(rank=4, alpha=8, targets=targets)
    mop = build_model(cfg, 0, lora=lora)
    missing, unexpected = mop.load_state_dict(load_hf(tmp_path / "base").state_dict(), strict=False)
    assert not unexpected and all(name.endswith(("lora_A", "lora_B")) for name in missing)
    adapters = randomize_adapters(mop)
    save_peft(tmp_path / "adapter", cfg, lora, adapters)
    theirs_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids, labels = batch(2), shifted(batch(2))
    ours, theirs = mop(ids), theirs_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for logits in (ours, theirs):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    names = adapter_names(cfg, lora)
    grads = {name: p.grad for name, p in theirs_model.named_parameters() if p.requires_grad}
    assert len(grads) == len(adapters) and all(key.startswith(PREFIX) for key in names.values())
    for name, p in adapters.items():
        key = names[name].removesuffix(".weight") + ".default.weight"  # PEFT's in-memory name
        theirs_grad = from_peft(name, grads[key], p.shape[0] if p.dim() == 3 else None)
        torch.testing.assert_close(p.grad, theirs_grad, atol=1e-6, rtol=1e-4, msg=name)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")


# ---------------------------------------------------------------- layouts


def test_lora_in_every_technique_trains_like_the_reference_on_an_fp8_base(tmp_path):
    """Adapters on attention and experts over an fp8-stored base (blocks of 16 x 8): 2 ranks with
    Ulysses, LLEP spilling in two chunks, the ring, checkpointing with offload and the host
    optimizer give the reference's losses and gradient norms."""
    fp8 = [*LORA, "--lora.base_format=fp8:16x8"]
    reference = run(tmp_path, "reference", *fp8)
    records = run(tmp_path, "mop", *fp8, *EVERY_TECHNIQUE, "--parallel.nproc=2")
    assert_same_run(records, reference)
    assert sum(r["llep_active"] for r in records) > 0 and losses(records)[-1] < losses(records)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "none"), ("deepseek_v3", "fp8:8x16"), ("gpt_oss", "mxfp4"),
                                         ("gpt_oss", "none")])
@pytest.mark.parametrize("layout", [
    ["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=4", "--parallel.expert=4",
     "--parallel.vocab=4", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0", "--parallel.llep_alpha=0.5",
     "--parallel.llep_min_chunk=4", "--parallel.llep_chunks=2", "--train.activation_checkpointing=full",
     "--train.offload_activations=true", "--optim.offload=true"],
    ["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=2", "--parallel.expert=4",
     "--parallel.vocab=2", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0", "--parallel.llep_alpha=0.5",
     "--parallel.llep_min_chunk=4", "--optim.offload=false"],
    ["--parallel.strategy=fsdp2", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
     "--parallel.vocab=1", "--parallel.expert_balance=ep", "--optim.offload=false"],
], ids=["4-ranks-everything", "4-ranks-ep4-sp2", "fsdp2-baseline"])
def test_lora_trains_like_the_reference_in_every_layout(tmp_path, reference_of, family, fmt, layout):
    args = [*LORA, *FAMILY_RUNS[family], f"--lora.base_format={fmt}"]
    assert_same_run(run(tmp_path, "layout", *args, *layout), reference_of(*args))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_lora_stays_within_the_bf16_tolerance_of_the_bf16_reference(tmp_path, family):
    args = [*LORA, *FAMILY_RUNS[family], "--train.dtype=bfloat16", "--lora.base_format=fp8:16x8"]
    reference = run(tmp_path, "reference", *args)
    records = run(tmp_path, "mop", *args, *EVERY_TECHNIQUE, "--parallel.nproc=2")
    assert losses(records) == pytest.approx(losses(reference), rel=2 ** -8)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=2 ** -8)


# ---------------------------------------------------------------- a published base, checkpoints


BASE_RUN = ["--parallel.strategy=reference", "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
            "--parallel.expert_balance=ep", "--optim.offload=false", "--data.seq_len=32", "--train.global_batch=4",
            "--train.micro_batch=2", "--train.steps=4", "--log.progress=false", "--log.tensorboard=false",
            "--log.plot=false", *LORA]


def published_pair(tmp_path, family: str):
    """A tiny HF model of `family` as it is published (deepseek_v3: fp8 blocks of 16 x 8 over expert
    rows of 24, so parts end in partial blocks; gpt_oss: MXFP4 experts) and a copy holding what the
    tests' own quantizer dequantizes it to."""
    import test_deepseek_v3
    import test_gpt_oss
    from safetensors.torch import load_file, save_file

    if family == "deepseek_v3":
        hf = test_deepseek_v3.random_hf_model(test_deepseek_v3.hf_config(vocab_size=300, moe_intermediate_size=24))
        quantize = lambda folder: test_deepseek_v3.quantize_fp8(folder, (16, 8))  # noqa: E731
    else:
        hf = test_gpt_oss.random_hf_model(test_gpt_oss.hf_config(vocab_size=300))
        quantize = test_gpt_oss.quantize_mxfp4
    published, reference = tmp_path / "hf" / "published", tmp_path / "hf" / "dequantized"
    hf.save_pretrained(published)
    hf.save_pretrained(reference)
    dequantized = quantize(published)
    weights = load_file(reference / "model.safetensors")
    save_file({**weights, **dequantized}, reference / "model.safetensors", metadata={"format": "pt"})
    return published, reference


def base_run(tmp_path, name, *extra):
    assert main(["train", *BASE_RUN, f"--log.run_dir={tmp_path / name}", *extra]) == 0
    return read_metrics(tmp_path / name / "metrics.jsonl"), json.loads((tmp_path / name / "config.json").read_text())


@pytest.mark.parametrize("family, published_format", [("deepseek_v3", "fp8:16x8"), ("gpt_oss", "mxfp4")])
def test_a_published_quantized_base_trains_like_its_dequantized_weights(tmp_path, family, published_format):
    """`lora.base` names the HF directory: the model comes from its config.json, the base stays in
    its published format ("auto"), read as published shard by shard, and the run equals the
    reference run on the weights the tests' own quantizer dequantizes it to."""
    published, dequantized = published_pair(tmp_path, family)
    reference, reference_config = base_run(tmp_path, "dequantized", f"--lora.base={dequantized}")
    layout = [*EVERY_TECHNIQUE, "--parallel.nproc=2", "--parallel.llep_min_chunk=2"]
    records, config = base_run(tmp_path, "published", f"--lora.base={published}", *layout)
    assert (config["lora"]["base_format"], reference_config["lora"]["base_format"]) == (published_format, "none")
    assert config["model"]["family"] == family
    assert_same_run(records, reference)
    # every stored tensor was read as published (its bytes and scales), none quantized again
    from mop.models.hf import HFWeights
    from mop.models.transformer import MoETransformer

    cfg = config_from_hf(published)
    with torch.device("meta"):
        meta = MoETransformer(cfg, LoraConfig(rank=4, base_format=published_format))
    shapes = dict(meta.named_parameters())
    with HFWeights(published) as weights:
        entries = stored_tensors(meta)
        assert entries and all(weights.stored_rows(entry, shapes[name].shape, 0, 1) is not None
                               for name, entry in entries.items())


def test_lora_checkpoints_hold_the_adapters_and_resume_in_another_layout(tmp_path):
    """A LoRA checkpoint holds the adapters and their moments (never the base) and the base it
    trained on; resumed on 2 ranks in another layout it continues the single-process run exactly."""
    from torch.distributed.checkpoint import FileSystemReader

    whole = run(tmp_path, "whole", *LORA, "--checkpoint.every=3")
    step = tmp_path / "whole" / "checkpoints" / "step_3"
    saved = FileSystemReader(step).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all(key.endswith(("lora_A", "lora_B")) for key in weights)
    assert json.loads((step / "mop.json").read_text())["lora_base"]["kind"] == "initial"
    resumed = run(tmp_path, "resumed", *LORA, f"--checkpoint.resume={step}", *EVERY_TECHNIQUE, "--parallel.nproc=2")
    assert [r["step"] for r in resumed] == [4, 5]
    assert_same_run(resumed, whole[3:])


# ---------------------------------------------------------------- outputs for serving


@pytest.fixture(scope="module")
def trained_on_a_hf_base(tmp_path_factory):
    """A LoRA run (2 ranks, every technique) over a tiny Qwen3-MoE HF directory: its base and last checkpoint."""
    tmp = tmp_path_factory.mktemp("served")
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0])
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(hf, 0, ".mlp.gate.weight")
    hf.save_pretrained(tmp / "hf" / "base")
    base_run(tmp, "run", f"--lora.base={tmp / 'hf' / 'base'}", *EVERY_TECHNIQUE, "--parallel.nproc=2")
    return tmp / "hf" / "base", tmp / "run" / "checkpoints" / "step_4"


def test_peft_loads_the_runs_adapters_onto_the_base_and_equals_the_merged_model(tmp_path, trained_on_a_hf_base):
    """Every LoRA checkpoint holds its adapters in PEFT's layout (`peft/`, as `mop convert to-peft`
    writes them); transformers' base model with them loaded by PEFT computes the logits of the
    merged model `mop convert merge` writes (fp32, 1e-5), which transformers loads too."""
    peft = pytest.importorskip("peft")
    base, step = trained_on_a_hf_base
    assert main(["convert", "to-peft", str(step), str(tmp_path / "adapter"), "--dtype=float32"]) == 0
    for name in ("adapter_config.json", "adapter_model.safetensors", "serve/adapter_config.json",
                 "serve/adapter_model.safetensors"):  # PEFT's layout, and the engines' (test_served_adapters)
        assert (step / "peft" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()
    assert main(["convert", "merge", str(step), str(tmp_path / "merged"), "--dtype=float32"]) == 0
    with_adapters = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager"), step / "peft")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    ids = batch(2)
    with torch.no_grad():
        theirs, ours = with_adapters(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    with torch.no_grad():
        assert (untrained(input_ids=ids).logits - ours).abs().max() > 1e-3  # the adapters trained


@pytest.mark.parametrize("family, method", [("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")])
def test_a_merge_is_requantized_to_the_published_format_of_its_base(tmp_path, family, method):
    """`mop convert merge --dtype=published` writes the merged weights of an fp8- or MXFP4-published
    base in its own layout (the same tensor names, dtypes and shapes, its quantization_config), each
    quantized tensor the merged fp32 weight re-quantized; merging onto another base is refused."""
    from safetensors import safe_open

    from mop.models.formats import Fp8Blocks, Mxfp4

    published, dequantized = published_pair(tmp_path, family)
    base_run(tmp_path, "run", f"--lora.base={published}")
    step = tmp_path / "run" / "checkpoints" / "step_4"
    assert main(["convert", "merge", str(step), str(tmp_path / "ours"), "--dtype=published"]) == 0
    assert main(["convert", "merge", str(step), str(tmp_path / "fp32"), "--dtype=float32"]) == 0
    quantization = json.loads((published / "config.json").read_text())["quantization_config"]
    fmt, suffixes = ((Fp8Blocks(tuple(quantization["weight_block_size"])), ("", "_scale_inv")) if method == "fp8"
                     else (Mxfp4(), ("_blocks", "_scales")))
    with safe_open(published / "model.safetensors", "pt") as theirs, \
            safe_open(tmp_path / "ours" / "model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "fp32" / "model.safetensors", "pt") as exact:
        assert set(ours.keys()) == set(theirs.keys())
        for key in ours.keys():
            assert (ours.get_slice(key).get_dtype(), ours.get_slice(key).get_shape()) == (
                theirs.get_slice(key).get_dtype(), theirs.get_slice(key).get_shape()), key
        quantized = [key for key in exact.keys() if key + suffixes[1] in theirs.keys()]
        assert quantized
        for key in quantized:
            for suffix, expected in zip(suffixes, fmt.quantize(exact.get_tensor(key))):
                assert torch.equal(ours.get_tensor(key + suffix).view(torch.uint8), expected.view(torch.uint8)), key
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["quantization_config"] == quantization
    assert main(["convert", "merge", str(step), str(tmp_path / "other"), f"--base={dequantized}"]) == 2
