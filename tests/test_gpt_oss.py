"""gpt_oss against transformers' GptOssForCausalLM: the same logits (and loss gradients) from the
same weights (copied by name, independently of the HF mapping, and through `load_hf` / `save_hf`)
over GQA ratios, odd heads, windows shorter and longer than the sequence, YaRN on and off, top-2
and top-3, a binding SwiGLU clamp; packed documents against each document alone; the sink and
window core against a dense-mask oracle, and its CUDA route (flash varlen, emulated on the CPU)
against its CPU one; the grouped experts against the per-expert loop; the experts under EP, LLEP
and chunked LLEP on 2 gloo ranks against the single process."""

import dataclasses
import inspect
import json
import re

import pytest
import torch

from mop.models import documents as documents_module
from mop.models.documents import Documents
from mop.models.gpt_oss import attention as attention_module
from mop.models.gpt_oss.attention import SinkWindowCore
from mop.models.gpt_oss.experts import NAMES, GptOssExperts
from mop.models.hf import HFConversionError, config_from_hf, load_hf, save_hf
from mop.models.transformer import build_model
from test_hf import HF_TO_MOP, SEQ, batch, copy_weights_by_name, randomize, shifted

transformers = pytest.importorskip("transformers")

GPT_OSS_TO_MOP = [(r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.gate_up_weight"),
                  (r"\.mlp\.experts\.gate_up_proj_bias$", ".mlp.experts.gate_up_bias"),
                  (r"\.mlp\.experts\.down_proj$", ".mlp.experts.down_weight"),
                  (r"\.mlp\.experts\.down_proj_bias$", ".mlp.experts.down_bias"), *HF_TO_MOP]
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_config(**overrides):
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                    rope_parameters=YARN, max_position_embeddings=32)
    settings.update(overrides)
    return transformers.GptOssConfig(**settings)


def random_hf_model(config, seed=0):
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(hf, seed, ".mlp.router.weight")
    return hf


CASES = {
    "gqa-4/2+window-5+yarn+top-2": {},
    "gqa-6/2+window-longer-than-the-sequence+rope+top-3": dict(
        num_attention_heads=6, sliding_window=64, rope_parameters=DEFAULT_ROPE, num_experts_per_tok=3),
    "odd-heads-3/3+window-3+yarn+top-3+clamp-binds": dict(
        num_attention_heads=3, num_key_value_heads=3, sliding_window=3, num_experts_per_tok=3, swiglu_limit=0.5),
    "no-attention-bias+window-1+4-layers": dict(attention_bias=False, sliding_window=1, num_hidden_layers=4,
                                                 rope_parameters=DEFAULT_ROPE),
}


def mop_twin(hf):
    mop = build_model(config_from_hf(hf.config.to_dict()), seed=0)
    copy_weights_by_name(hf, mop, GPT_OSS_TO_MOP)
    return mop


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case):
    hf = random_hf_model(hf_config(**CASES[case]))
    mop = mop_twin(hf)
    with torch.no_grad():
        input_ids = batch(2)
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["gqa-4/2+window-5+yarn+top-2", "odd-heads-3/3+window-3+yarn+top-3+clamp-binds"])
def test_loss_and_every_gradient_equal_transformers(case):
    hf = random_hf_model(hf_config(**CASES[case]))
    mop = mop_twin(hf)
    mop.cfg = dataclasses.replace(mop.cfg, aux_loss_coef=0.0)  # HF adds its aux loss only with output_router_logits
    input_ids = batch(2)
    labels = batch(2, seed=5)
    expected = hf(input_ids, labels=labels).loss
    loss = mop(input_ids, shifted(labels))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    expected.backward()
    loss.backward()
    mine = dict(mop.named_parameters())
    for name, param in hf.named_parameters():
        for pattern, replacement in GPT_OSS_TO_MOP:
            name = re.sub(pattern, replacement, name)
        torch.testing.assert_close(mine[name].grad, param.grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("case", ["gqa-4/2+window-5+yarn+top-2", "no-attention-bias+window-1+4-layers"])
def test_load_hf_and_save_hf_round_trip_through_transformers(tmp_path, case):
    hf = random_hf_model(hf_config(**CASES[case]), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    mop = load_hf(tmp_path / "hf")
    assert mop.cfg.options.sliding_window == hf.config.sliding_window
    input_ids = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(mop(input_ids), hf(input_ids).logits, atol=1e-5, rtol=0)
    save_hf(mop, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert again.config.layer_types == hf.config.layer_types
    assert load_hf(tmp_path / "back").cfg == mop.cfg
    rope = again.config.rope_parameters
    if hf.config.rope_parameters["rope_type"] == "yarn":
        assert rope == hf.config.rope_parameters
    else:  # the default RoPE goes out as YaRN at factor 1, the same frequencies: vLLM's gpt-oss reads YaRN's keys
        assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == (
            "yarn", 1.0, hf.config.rope_parameters["rope_theta"])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids).logits, hf(input_ids).logits, atol=1e-5, rtol=0)


@pytest.fixture
def small_segments(monkeypatch):
    """Documents of 6 tokens or more are runs (the query-block path past the window), shorter ones
    are packed in groups of at most 12 tokens: every segment kind at test sizes."""
    monkeypatch.setattr(documents_module, "SHORT_DOCUMENT", 6)
    monkeypatch.setattr(documents_module, "PACK_TOKENS", 12)


def document_ids(lengths_per_row):
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths_per_row])


def test_packed_documents_equal_each_document_alone_through_transformers(small_segments):
    """Rows of documents: runs of equal length, documents longer than the window (3), packs of
    short ones; each document's logits are transformers' on that document alone."""
    hf = random_hf_model(hf_config(sliding_window=3))
    mop = mop_twin(hf)
    rows = [[9, 9, 3, 2, 1], [4, 4, 16]]
    ids = document_ids(rows)
    input_ids = batch(2)
    with torch.no_grad():
        logits = mop(input_ids, document_ids=ids)
        for r, row in enumerate(rows):
            start = 0
            for length in row:
                alone = hf(input_ids[r:r + 1, start:start + length]).logits[0]
                torch.testing.assert_close(logits[r, start:start + length], alone, atol=1e-5, rtol=0)
                start += length


def dense_oracle(q, k, v, sinks, ids, window, scale):
    """The sink-corrected attention under the dense `[S, S]` mask causal & same document & window."""
    seq = q.shape[1]
    position = torch.arange(seq)
    mask = (position[:, None] >= position[None, :]) & (ids[:, :, None] == ids[:, None, :])
    if window is not None:
        mask = mask & (position[:, None] - position[None, :] < window)
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("window", [None, 1, 3, 5, 40])
@pytest.mark.parametrize("rows", [None, [[9, 9, 3, 2, 1], [4, 4, 16]], [[12, 12], [1, 23]]])
def test_the_core_equals_a_dense_mask_oracle_with_its_gradients(small_segments, window, rows):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, SEQ, heads, 8, generator=generator, dtype=torch.float64, requires_grad=True)
               for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = document_ids(rows) if rows else torch.zeros(2, SEQ, dtype=torch.long)
    out = SinkWindowCore(window)(q, k, v, Documents.from_ids(ids), sinks)
    expected = dense_oracle(q, k, v, sinks, ids, window, 8 ** -0.5)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    mine = torch.autograd.grad(out, (q, k, v, sinks), grad)
    theirs = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    for name, a, b in zip("q k v sinks".split(), mine, theirs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


class FlashStandIn:
    """A CPU stand-in for one of torch's flash varlen ops (`torch_attn::_varlen_attn`, its backward):
    calls bind against `schema` (this torch's, or one without some arguments: binding raises
    TypeError where the real op would) and run `compute` on the bound arguments, defaults applied.
    `default._schema` is where the core reads which arguments the op takes."""

    def __init__(self, schema, compute):
        self.default, self._schema, self.compute, self.calls = self, schema, compute, 0
        kind = {False: inspect.Parameter.POSITIONAL_OR_KEYWORD, True: inspect.Parameter.KEYWORD_ONLY}
        self.signature = inspect.Signature([
            inspect.Parameter(a.name, kind[a.kwarg_only],
                              default=a.default_value if a.has_default_value() else inspect.Parameter.empty)
            for a in schema.arguments])

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls += 1
        return self.compute(**bound.arguments)


def schema_without(schema, *names):
    """`schema` without the arguments `names` (those it has): the ops of a torch that lacks them."""
    text = str(schema)
    for name in names:
        text = re.sub(rf", [^,(]* {name}(=[^,)]*)?(?=[,)])", "", text)
    reduced = torch._C.parse_schema(text)
    assert not set(names) & {a.name for a in reduced.arguments}
    return reduced


def flash_scores(query, key, cu, is_causal, window_size, scale):
    """Flash's scaled scores `[heads, T, T]` over the stream, -inf where its varlen mask hides a key:
    query i sees key j of its own span iff i - left <= j <= i + right, a side of -1 unbounded,
    `is_causal` setting right to 0. K heads are repeated to the query heads (flash's GQA). Returns
    the scores and the scale (None: 1/sqrt(d), the kernel's default)."""
    left, right = window_size if window_size is not None else (-1, -1)
    right = 0 if is_causal else right
    ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff().long())
    distance = torch.arange(ids.numel())[:, None] - torch.arange(ids.numel())[None, :]  # i - j
    visible = (ids[:, None] == ids[None, :]) & ((distance <= left) | (left < 0)) & ((-distance <= right) | (right < 0))
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return (torch.einsum("qhd,khd->hqk", query, key) * scale).masked_fill(~visible, float("-inf")), scale


def check_spans(cu_seq_q, cu_seq_k, max_q, max_k):
    """What the core must hand flash: one int32 `cu_seqlens` for queries and keys, their longest span."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int(cu_seq_q.diff().max())


def flash_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, window_size, scale=None,
                  enable_gqa=False, **inference_only):
    """`_varlen_attn`: the output `[T, heads, d]`, L `[heads, T]` (fp32 on the GPU, the inputs' dtype
    here) and a dropout-free rng state; unequal head counts need `enable_gqa`, as torch's wrapper says."""
    check_spans(cu_seq_q, cu_seq_k, max_q, max_k)
    assert all(value is None for value in inference_only.values())
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise RuntimeError("flash varlen: unequal query and key heads need enable_gqa=True")
    scores, _ = flash_scores(query, key, cu_seq_q, is_causal, window_size, scale)
    lse = scores.logsumexp(-1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", (scores - lse.unsqueeze(-1)).exp(), value)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def flash_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                   window_size, scale=None):
    """`_varlen_attn_backward` as flash computes it from whatever `out` and `lse` it is given: P =
    exp(S - L), D = rowsum(dO o), dS = P (dP - D); grouped K/V's gradients summed over their group."""
    check_spans(cu_seq_q, cu_seq_k, max_q, max_k)
    group = query.shape[1] // key.shape[1]
    scores, scale = flash_scores(query, key, cu_seq_q, is_causal, window_size, scale)
    probs = (scores - lse.unsqueeze(-1)).exp()
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    delta = (grad_out * out).sum(-1).t()
    grad_scores = probs * (torch.einsum("qhd,khd->hqk", grad_out, value) - delta.unsqueeze(-1)) * scale
    grad_q = torch.einsum("hqk,khd->qhd", grad_scores, key)
    grad_k = torch.einsum("hqk,qhd->khd", grad_scores, query)
    grad_v = torch.einsum("hqk,qhd->khd", probs, grad_out)
    return grad_q, *(t.unflatten(1, (-1, group)).sum(2) for t in (grad_k, grad_v))


def core_output_and_grads(core, q, k, v, sinks, documents, upstream):
    out = core(q, k, v, documents, sinks)
    return out, *torch.autograd.grad(out, (q, k, v, sinks), upstream)


def core_inputs(heads, kv_heads, dim=8):
    """fp32 q, k, v `[2, SEQ, heads, dim]`, sinks and the output gradient, the tensors of
    bf16-representable values (the CUDA test compares bf16 with fp32 on the same inputs)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, SEQ, n, dim, generator=generator).bfloat16().float() for n in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=generator)
    return q, k, v, sinks, torch.randn(2, SEQ, heads, dim, generator=generator).bfloat16().float()


@pytest.mark.parametrize("schema", ["this-torch", "without-enable_gqa-and-scale"])
@pytest.mark.parametrize("heads, kv_heads, scale", [(4, 2, 0.3), (3, 3, None)])
@pytest.mark.parametrize("window", [None, 1, 3, 5, 40])
@pytest.mark.parametrize("rows", [None, [[9, 9, 3, 2, 1], [4, 4, 16]], [[12, 12], [1, 23]]])
def test_the_flash_path_equals_the_cpu_path_with_its_gradients(monkeypatch, small_segments, schema, heads, kv_heads,
                                                               scale, window, rows):
    """The CUDA route (flash varlen over the stream, window `(W - 1, 0)`, L `[heads, T]`, the sink
    backward through flash's backward with `y` and `c g`), run on the CPU through stand-ins with
    flash's semantics and this torch's op schemas (or ones without `enable_gqa` and `scale`, as
    torch 2.11's forward lacks `enable_gqa`): output and q, k, v, sink gradients equal the CPU
    path's, for windows shorter and longer than the documents, packs, GQA, one document a row."""
    from torch.nn.attention import varlen  # noqa: F401  (registers the ops whose schemas the stand-ins take)

    schemas = [torch.ops.torch_attn._varlen_attn.default._schema,
               torch.ops.torch_attn._varlen_attn_backward.default._schema]
    if schema != "this-torch":
        schemas = [schema_without(schemas[0], "enable_gqa", "scale"), schema_without(schemas[1], "scale")]
    ops = FlashStandIn(schemas[0], flash_forward), FlashStandIn(schemas[1], flash_backward)
    q, k, v, sinks, upstream = (t.requires_grad_() for t in core_inputs(heads, kv_heads))
    documents = Documents.from_ids(document_ids(rows)) if rows else None
    core = SinkWindowCore(window, scale)
    expected = core_output_and_grads(core, q, k, v, sinks, documents, upstream)
    monkeypatch.setattr(attention_module, "_flash_ops", lambda: ops)
    monkeypatch.setattr(attention_module, "varlen_dtype", lambda q: q.dtype)  # route to flash on the CPU
    got = core_output_and_grads(core, q, k, v, sinks, documents, upstream)
    assert [op.calls for op in ops] == [1, 1]
    for name, a, b in zip("out q k v sinks".split(), got, expected):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash varlen kernel needs a GPU")
@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("rows", [None, [[9, 9, 3, 2, 1], [4, 4, 16]]])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_cuda_flash_path_matches_the_cpu_path(window, rows, autocast):
    """bf16 flash varlen on the GPU against the fp32 CPU path on the same bf16-rounded inputs (fp32
    sinks): bf16 output rounding and gradient accumulation bound the difference. Under autocast the
    inputs arrive in fp32 and still take flash."""
    q, k, v, sinks, upstream = (t.requires_grad_() for t in core_inputs(4, 2, dim=16))
    ids = document_ids(rows) if rows else torch.zeros(2, SEQ, dtype=torch.long)
    core = SinkWindowCore(window)
    expected = core_output_and_grads(core, q, k, v, sinks, Documents.from_ids(ids), upstream)
    dtype = torch.float32 if autocast else torch.bfloat16
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_() for t in (q, k, v))
    sinks = sinks.detach().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert documents_module.varlen_dtype(q) == torch.bfloat16
        got = core_output_and_grads(core, q, k, v, sinks, Documents.from_ids(ids.cuda()), upstream.cuda().bfloat16())
    for name, a, b in zip("out q k v sinks".split(), got, expected):
        torch.testing.assert_close(a.float().cpu(), b, atol=3e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("grouped, align", [(True, None), (True, 8)])
def test_grouped_experts_equal_the_per_expert_loop(grouped, align):
    from mop.models.config import ModelConfig

    cfg = ModelConfig(family="gpt_oss", hidden=16, experts=4, top_k=2, expert_intermediate=8, qk_norm=False,
                      options={"swiglu_limit": 1.0})
    experts = build_model(cfg, seed=0).layers[0].mlp.experts
    assert isinstance(experts, GptOssExperts)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=generator, requires_grad=True)
    ids = torch.stack([torch.randperm(3, generator=generator)[:2] for _ in range(10)])  # expert 3 gets no rows
    weights = torch.rand(10, 2, generator=generator)
    results = []
    for kind in ((False, None), (grouped, align)):
        out = experts(x, ids, weights, *kind)
        results.append((out, *torch.autograd.grad(out.square().sum(), (x, *experts.parameters()))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


EP_CASES = [("ep", 1), ("llep", 1), ("llep", 2)]  # (expert_balance, llep_chunks)


def ep_config():
    from mop.models.config import ModelConfig

    return ModelConfig(family="gpt_oss", hidden=16, experts=8, top_k=2, expert_intermediate=8, qk_norm=False,
                       options={"swiglu_limit": 1.0})


def random_experts() -> GptOssExperts:
    """Every tensor random, the biases included (a model starts them at zero), the clamp binding."""
    experts = GptOssExperts(ep_config())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return experts


def ep_inputs(world: int, kind: str):
    """Every rank's tokens, routing and output gradient, `[world, TOKENS, ...]`."""
    from test_llep import TOKENS, routing

    ids, weights = routing(kind, world, 2, seed=3)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(world, TOKENS, 16, generator=generator)
    return x, ids, weights, torch.randn(world, TOKENS, 16, generator=generator)


def expert_parallel_rank(rank, world, kinds):
    from mop.parallel import DistLayout, Layout
    from mop.parallel.experts import shard_experts
    from mop.parallel.llep import BalanceOptions
    from mop.testing import rank_device
    from test_llep import _Holder

    layout = DistLayout(Layout(world, expert=world), rank_device())
    results = []
    for kind in kinds:
        for mode, chunks in EP_CASES:
            holder = _Holder(random_experts().to(layout.device))
            shard_experts(holder, layout, BalanceOptions(mode, gate=1.0, alpha=1.0, min_chunk=2, chunks=chunks),
                          torch.float32)
            module = holder.layers[0].mlp.experts
            x_all, ids, weights, upstream = ep_inputs(world, kind)
            x = x_all[rank].to(layout.device).requires_grad_()
            w = weights[rank].to(layout.device).requires_grad_()
            out = module(x, ids[rank].to(layout.device), w)
            (out * upstream[rank].to(layout.device)).sum().backward()
            grads = {name: p.grad.full_tensor().cpu() for name, p in module.named_parameters()}
            results.append((out.detach().cpu(), x.grad.cpu(), w.grad.cpu(), grads, module.records[0]["llep_active"]))
    return results


@pytest.mark.parametrize("kind", ["skewed", "empty"])
def test_expert_parallelism_of_the_experts_equals_the_single_process(kind):
    """EP, LLEP forced to spill (gate 1.0, chunks of 2 rows) and chunked LLEP (2 chunks) on 2 gloo
    ranks: each rank's outputs and the gradients of its tokens and routing weights, and every expert
    tensor's gradient (the biases included, the partitions gathered from their FSDP2 shards), equal
    the single-process experts on all the tokens."""
    from mop.testing import run_distributed
    from test_llep import TOKENS

    world = 2
    results = run_distributed(expert_parallel_rank, world, [kind])
    experts = random_experts()
    x_all, ids, weights, upstream = ep_inputs(world, kind)
    x = x_all.reshape(-1, 16).requires_grad_()
    w = weights.reshape(-1, 2).clone().requires_grad_()
    out = experts(x, ids.reshape(-1, 2), w)
    (out * upstream.reshape(-1, 16)).sum().backward()
    per = experts.num_experts // world
    for index, (mode, chunks) in enumerate(EP_CASES):
        for rank, (r_out, r_x, r_w, grads, spilled) in enumerate(r[index] for r in results):
            label = f"{kind} {mode} chunks={chunks} rank {rank}"
            rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
            torch.testing.assert_close(r_out, out.detach()[rows], atol=1e-5, rtol=1e-5, msg=f"output {label}")
            torch.testing.assert_close(r_x, x.grad[rows], atol=1e-5, rtol=1e-5, msg=f"input grad {label}")
            torch.testing.assert_close(r_w, w.grad[rows], atol=1e-5, rtol=1e-5, msg=f"routing weight grad {label}")
            assert tuple(grads) == NAMES, label  # the unwrapped model's names: checkpoints and views see them
            owned = slice(rank * per, (rank + 1) * per)
            for name in NAMES:
                expected = getattr(experts, name).grad[owned]
                torch.testing.assert_close(grads[name], expected, atol=1e-5, rtol=1e-5, msg=f"{name} {label}")
            assert spilled if mode == "llep" else not spilled, label  # gate 1.0: LLEP spills any imbalance


def test_the_probe_is_the_product_with_the_output_and_its_backward_the_experts_backward():
    """`gpt_oss_experts(probe=g)` (the chunked backward's product, without the down projection's
    forward) is `<g, expert(x)>` per row, and its backward for row weights w is the experts'
    backward for the output gradient `w * g`, in the per-expert and the grouped form (padded too)."""
    from mop.models.gpt_oss.experts import gpt_oss_experts

    experts = random_experts()
    generator = torch.Generator().manual_seed(2)
    counts = [3, 0, 5, 1, 0, 4, 2, 1]
    x = torch.randn(sum(counts), 16, generator=generator, requires_grad=True)
    probe, w = torch.randn(sum(counts), 16, generator=generator), torch.rand(sum(counts), generator=generator)
    stacked = tuple(getattr(experts, name) for name in NAMES)
    out = gpt_oss_experts(x, counts, stacked, experts.alpha, experts.limit, grouped=False)
    expected = torch.autograd.grad(out, (x, *stacked), w.unsqueeze(-1) * probe)
    for grouped, align in ((False, None), (True, None), (True, 8)):
        product = gpt_oss_experts(x, counts, stacked, experts.alpha, experts.limit, grouped, align, probe)
        torch.testing.assert_close(product, (out * probe).sum(-1), atol=1e-5, rtol=1e-5)
        for a, b in zip(torch.autograd.grad(product, (x, *stacked), w), expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_what_the_mapping_refuses_it_says_in_one_line():
    config = hf_config().to_dict()
    with pytest.raises(HFConversionError, match="layer_types"):
        config_from_hf({**config, "layer_types": ["full_attention"] * 3})


def test_a_config_json_without_rope_settings_gets_the_references_yarn():
    config = {k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    options = config_from_hf(config).options
    assert (options.yarn_factor, options.yarn_original_context, options.yarn_truncate) == (32.0, 4096, False)
    assert json.dumps(transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "model_type"}).rope_parameters)


GPT_OSS_RUN = ["--model.family=gpt_oss", "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8",
               "--model.qk_norm=false", "--model.options.sliding_window=5", "--model.options.yarn_factor=4",
               "--model.options.yarn_original_context=8", "--model.layers=2", "--model.aux_loss_coef=0.01"]


@pytest.mark.slow
def test_the_mop_layout_with_chunked_llep_trains_like_the_reference(tmp_path):
    """On 4 ranks: the experts partitioned over 4 ranks under chunked LLEP forced to spill (gate 1.0,
    chunks of 4 rows, 2 chunks), Ulysses with sinks over sliding and full blocks in two head
    chunks, the vocabulary ring, block checkpointing with offload and the host optimizer."""
    from test_train import losses, run

    reference = run(tmp_path, "reference", *GPT_OSS_RUN)
    records = run(tmp_path, "all", *GPT_OSS_RUN, "--parallel.strategy=mop", "--parallel.nproc=4",
                  "--parallel.sequence=2", "--parallel.expert=4", "--parallel.vocab=2",
                  "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0", "--parallel.llep_min_chunk=4",
                  "--parallel.llep_chunks=2", "--parallel.attention_head_chunks=2",
                  "--train.activation_checkpointing=full", "--train.offload_activations=true",
                  "--optim.offload=true")
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)
    assert sum(r["llep_active"] for r in records) > 0  # the spill ran


def test_the_debug_config_resolves_with_expert_parallelism():
    """gpt_oss's debug config leaves every degree automatic: on 2 ranks, expert parallelism (LLEP),
    Ulysses and the vocabulary ring each take both."""
    from pathlib import Path

    from mop.config import load_config
    from mop.settle import settle

    resolved = settle(load_config(Path(__file__).resolve().parents[1] / "configs/debug-gpt-oss.toml", []), fit_memory=False)
    p = resolved.parallel
    assert (p.expert, p.sequence, p.vocab, p.expert_balance) == (2, 2, 2, "llep")


def quantize_mxfp4(folder) -> dict:
    """The test's own MXFP4 quantizer, as OpenAI publishes gpt-oss: each expert tensor `P [E, a, b]`
    becomes `P_blocks [E, b, a / 32, 16]` (two e2m1 codes a byte, low nibble first) and `P_scales
    [E, b, a / 32]` (the power of two of each 32 values, +127) in place, with the config's
    `quantization_config`; returns what its dequantization gives for each of them."""
    from safetensors.torch import load_file, save_file

    from mop.models.formats import E2M1

    table = torch.tensor(E2M1)
    tensors = load_file(folder / "model.safetensors")
    dequantized = {}
    for key in [key for key in tensors if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        grouped = tensors.pop(key).float().transpose(1, 2).unflatten(-1, (-1, 32))  # [E, b, a / 32, 32]
        exponent = torch.ceil(torch.log2(grouped.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
        codes = ((grouped / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - table).abs().argmin(-1)
        tensors[key + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        tensors[key + "_scales"] = (exponent + 127).to(torch.uint8)
        dequantized[key] = (table[codes] * torch.exp2(exponent).unsqueeze(-1)).flatten(-2).transpose(1, 2).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router"]}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


def test_mxfp4_experts_load_dequantized_expert_by_expert(tmp_path):
    """A checkpoint as gpt-oss is published (MXFP4 expert blocks and scales) loads to the logits that
    transformers computes on the weights this test dequantized itself; a shard's experts dequantize
    alone to the same values."""
    from safetensors.torch import load_file, save_file

    from mop.models.hf import HFWeights

    hf = random_hf_model(hf_config(intermediate_size=32))
    hf.save_pretrained(tmp_path / "mxfp4")
    hf.save_pretrained(tmp_path / "dequantized")
    dequantized = quantize_mxfp4(tmp_path / "mxfp4")
    weights = load_file(tmp_path / "dequantized" / "model.safetensors")
    save_file({**weights, **dequantized}, tmp_path / "dequantized" / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", attn_implementation="eager")
    mop = load_hf(tmp_path / "mxfp4")
    with torch.no_grad():
        torch.testing.assert_close(mop(batch(2)), reference(batch(2)).logits, atol=1e-5, rtol=0)
    with HFWeights(tmp_path / "mxfp4") as read:
        name = "layers.1.mlp.experts.down_weight"
        full = dict(mop.named_parameters())[name]
        torch.testing.assert_close(read.rows(name, full.shape, 3, 4), full[3:7].detach(), atol=0, rtol=0)


@pytest.mark.slow
def test_bf16_in_the_mop_layout_stays_within_the_bf16_tolerance_of_the_bf16_reference(tmp_path):
    """As deepseek_v3's: losses and gradient norms within 2^-8 relative of the bf16 reference."""
    from test_layouts import check_bf16_mop_layout_against_the_bf16_reference

    check_bf16_mop_layout_against_the_bf16_reference(tmp_path, GPT_OSS_RUN, [
        "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=1", "--parallel.vocab=2",
        "--train.activation_checkpointing=full"])
