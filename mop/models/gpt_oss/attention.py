"""gpt-oss attention: grouped-query attention with biases, learned sinks and alternating windows.

Per block (the shared `mop.models.attention.Attention`, built by `gpt_oss_attention`): q, k, v =
biased projections; q and k turned by RoPE (YaRN without truncation, `mop.models.rope`);
`out = o_proj(core(q, k, v, documents, sinks))`, o biased too. Blocks whose
index is even are sliding-window layers (a query at position p sees keys p - W + 1 .. p of its own
document, W = `options.sliding_window`), the odd ones attend causally to the whole document.

Sinks. Head h has a learned logit `s_h` that joins its softmax denominator and has no value:
`y = sum_j exp(z_j) v_j / (sum_j exp(z_j) + exp(s_h))`. With `o` the attention output without the
sink and `L` its log-sum-exp, that is exactly `y = o * sigmoid(L - s_h)`, so the sink is added on
top of any kernel that returns L. Gradient: the kernel's backward, called with the output
gradient `c g` (c = sigmoid(L - s)) and with `y` in place of its saved output, recomputes
`p_j = exp(z_j - L)` and `D = <c g, y>`, and so gives `dz_j = p_j (c <g, v_j> - c <g, y>)`, the
gradient of the sink-corrected softmax; the sink's own gradient is `-sum (1 - c) <g, y>`. No
gradient flows through L: kernels' backwards (flash's on CUDA, the CPU kernel's) discard an L
gradient, which is why the correction is one autograd function around the kernel
(`_SinkAttention`, `_SinkVarlen`) and not `o * sigmoid(L - s)` in autograd.

Kernels (`SinkWindowCore` picks by `documents.varlen_dtype`, as `document_attention` does):
- CUDA in bf16/fp16 (Ampere or newer, head dim a multiple of 8 up to 256): torch's flash varlen
  ops `torch.ops.torch_attn._varlen_attn` and `_varlen_attn_backward` (the ones under
  `varlen_attn`; they return and take L) in one call over the whole flattened stream, cut by the
  documents' `cu_seqlens` (a micro-batch without `Documents`: one document per row of S). Window
  `(W - 1, 0)` in sliding blocks (flash's left bound excludes the query, W counts it), `(-1, 0)`
  in full ones: the window comes free, no document is crossed, no mask is built, the statistics
  are O(tokens x heads). `_SinkVarlen` wraps the two ops with the sink as above: L arrives as
  `[heads, tokens]` (fp32), `y` is computed in fp32 and stored in the compute dtype, the backward
  op gets `y` as its output and `c g` as its output gradient. The ops' arguments differ across
  torch versions and are read from their schemas, never from the version: where the forward has
  no `enable_gqa` (torch 2.11) K/V are repeated to the query heads before `_SinkVarlen` (autograd
  sums their gradients), where it has no `scale` q is pre-scaled, by `documents.varlen_operands`,
  the helper `document_attention` uses; the backward op never takes `enable_gqa` (flash's
  backward takes grouped K/V as they are). An L in another layout (torch 2.11's batched one on
  ROCm) raises. Verified on the CPU only, against an emulation of the two ops (the tests'
  stand-ins: flash's varlen window mask, L `[heads, tokens]`, a backward from the given output and
  L with `D = rowsum(dO o)`, `dS = P (dP - D)`) on this torch's op schemas and on ones without
  `enable_gqa` and `scale`; never run on a GPU (a `cuda` test compares the real kernel in bf16 with
  the CPU path where there is one). Other CUDA cases (fp32, older GPUs, other head dims) raise.
- Everywhere else (the CPU): the segment path below, with the CPU flash attention kernel
  (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which take the output and
  L explicitly) under `_SinkAttention`.

Segments (the CPU path): the micro-batch's stream is cut into the segments of
`Documents.segments` (runs of equal-length documents, packs of short ones), so no window crosses
a document. A run of documents of length L attends with one causal call when L <= W; otherwise
in query blocks of W tokens: block 0 causally against itself, every later block against the 2W
keys of the previous block and its own under one shared `[W, 2W]` band mask (key kk visible to
query qq iff qq < kk <= qq + W). A pack of short documents attends under its own `[g, g]` mask
and the band. Memory: a copy of K and V in the overlapping blocks (2 x), masks of W x 2W and
PACK_TOKENS^2 elements, the kernel's O(tokens x heads) statistics; never an `[S, S]` tensor.

Sequence parallelism: the core takes the sinks of the heads it is given (`sinks [heads of q]`);
`mop.parallel.ulysses` hands each head chunk's core the matching slice of the attention's sinks (its
per-head values) and returns their gradient.
"""

from __future__ import annotations

from functools import cache, partial

import torch

from mop.models.attention import Attention, AttentionCore
from mop.models.documents import Documents, Segment, varlen_dtype, varlen_operands
from mop.models.shape import ModelShape

_forward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _SinkAttention(torch.autograd.Function):
    """`y = attention(q, k, v) * sigmoid(L - sinks)` on `[n, heads, len, d]` tensors (the module
    docstring); `mask` an additive `[lq, lk]` mask or None for causal."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, scale):
        causal = mask is None
        out, lse = _forward_kernel(q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
        keep = _keep(lse, sinks, out.dtype)
        y = (out.to(keep.dtype) * keep).to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse, sinks, mask)
        ctx.causal, ctx.scale = causal, scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, y, lse, sinks, mask = ctx.saved_tensors
        keep = _keep(lse, sinks, y.dtype)
        grad_y = grad_y.to(keep.dtype)
        grad_out = (grad_y * keep).to(q.dtype)
        grad_q, grad_k, grad_v = _backward_kernel(grad_out, q, k, v, y, lse, 0.0, ctx.causal, attn_mask=mask,
                                                  scale=ctx.scale)
        grad_sinks = -((1 - keep) * (grad_y * y.to(keep.dtype))).sum((0, 2, 3))
        return grad_q, grad_k, grad_v, grad_sinks.to(sinks.dtype), None, None


def _keep(lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The share of each query's softmax mass the sink leaves to the keys, `sigmoid(L - s)`
    `[n, heads, len, 1]`, in fp32 at least (in `dtype` if wider)."""
    dtype = torch.promote_types(dtype, torch.float32)
    return torch.sigmoid(lse.to(dtype) - sinks.to(dtype).view(1, -1, 1)).unsqueeze(-1)


def _flash_ops():
    """torch's flash varlen forward and backward ops, registered by `torch.nn.attention.varlen`
    (which `varlen_dtype` imported before choosing them); the tests swap in CPU stand-ins."""
    return torch.ops.torch_attn._varlen_attn, torch.ops.torch_attn._varlen_attn_backward


@cache
def _takes(op, argument: str) -> bool:
    """Whether `op`'s schema has `argument`: the ops' arguments differ across torch versions."""
    return argument in {a.name for a in op.default._schema.arguments}


class _SinkVarlen(torch.autograd.Function):
    """`y = flash(q, k, v) * sigmoid(L - sinks)` on the flattened stream (`q [T, heads, d]`, k and v
    with the heads `options` allow) over the documents `cu`, within `window` (flash's `(left,
    right)`); the backward is flash's with `y` and `c g` (the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, longest, window, options):
        causal = window == (-1, 0)  # as varlen_attn says it
        out, lse, rng_state = _flash_ops()[0](q, k, v, cu, cu, longest, longest, causal, window_size=list(window),
                                              **options)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise NotImplementedError(f"flash varlen returned L of shape {tuple(lse.shape)}, not [heads, tokens] "
                                      "(a batched layout, as torch 2.11 on ROCm): not handled")
        keep = _stream_keep(lse, sinks, out.dtype)
        y = (out.to(keep.dtype) * keep).to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse, sinks, cu, rng_state)
        ctx.longest, ctx.causal, ctx.window = longest, causal, window
        # the backward op has no enable_gqa: flash's backward takes grouped K/V as they are
        ctx.options = {name: value for name, value in options.items() if name != "enable_gqa"}
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, y, lse, sinks, cu, rng_state = ctx.saved_tensors
        keep = _stream_keep(lse, sinks, y.dtype)
        grad_y = grad_y.to(keep.dtype)
        grad_out = (grad_y * keep).to(q.dtype)
        grad_q, grad_k, grad_v = _flash_ops()[1](grad_out, q, k, v, y, lse, cu, cu, ctx.longest, ctx.longest,
                                                 ctx.causal, rng_state, window_size=list(ctx.window), **ctx.options)
        grad_sinks = -((1 - keep) * (grad_y * y.to(keep.dtype))).sum((0, 2))
        return grad_q, grad_k, grad_v, grad_sinks.to(sinks.dtype), None, None, None, None


def _stream_keep(lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_keep` for flash varlen's L `[heads, T]`, laid out as the stream `[T, heads, 1]`."""
    return _keep(lse.unsqueeze(0), sinks, dtype)[0].transpose(0, 1)


def sink_attention(q, k, v, sinks, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`[n, len, heads, d]` in and out (kv heads may be fewer: grouped-query attention)."""
    out = _SinkAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks, mask, scale)
    return out.transpose(1, 2)


def band(queries: int, keys: int, offset: int, window: int, device) -> torch.Tensor:
    """Boolean `[queries, keys]`: query at position `offset + i` sees key `j` iff `0 <= offset + i - j < window`."""
    distance = offset + torch.arange(queries, device=device)[:, None] - torch.arange(keys, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the kernel takes it: 0 where visible, -inf elsewhere, in the queries' dtype."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class SinkWindowCore(AttentionCore):
    """The gpt-oss sequence-mixing core: causal attention within each document, within `window`
    keys when set, with per-head sinks (the module docstring). `forward(q, k, v, documents,
    sinks)`: `sinks [heads]` are those of q's heads."""

    def __init__(self, window: int | None, scale: float | None = None):
        super().__init__(scale)
        self.window = window

    def forward(self, q, k, v, documents: Documents | None, sinks: torch.Tensor) -> torch.Tensor:
        if documents is not None and documents.prefixes:
            raise NotImplementedError("gpt_oss attention does not attend branches (a shared prompt's second "
                                      "response) yet: its sinks and windows over a prefix are not built")
        dtype = varlen_dtype(q)
        if dtype is not None:
            return self._varlen(q.to(dtype), k.to(dtype), v.to(dtype), documents, sinks)
        if q.device.type != "cpu":
            raise NotImplementedError("gpt_oss attention on CUDA runs flash varlen only: bf16/fp16 compute, an "
                                      "Ampere or newer GPU, a head dim that is a multiple of 8 up to 256")
        batch, seq = q.shape[:2]
        segments = documents.segments if documents is not None else (Segment(batch, seq),)
        # one split per tensor along the stream, as `mop.models.documents._segments` (its backward is one cat)
        sizes = [s.count * s.length for s in segments]
        pieces = [t.reshape(-1, *t.shape[2:]).split(sizes) for t in (q, k, v)]
        outputs = [self._segment(s, *(t.unflatten(0, (s.count, s.length)) for t in ts), sinks).flatten(0, 1)
                   for s, *ts in zip(segments, *pieces)]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out.reshape(*q.shape[:-1], v.shape[-1])

    def _varlen(self, q, k, v, documents: Documents | None, sinks) -> torch.Tensor:
        """The flash path (the module docstring): the whole stream in one call."""
        batch, seq = q.shape[:2]
        if documents is None:  # one document per row
            cu, longest = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device), seq
        else:
            cu, longest = documents.cu_seqlens, documents.max_length
        stream, options = varlen_operands(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), q.shape[2] != k.shape[2],
                                          self.scale, partial(_takes, _flash_ops()[0]))
        window = (-1, 0) if self.window is None else (self.window - 1, 0)
        out = _SinkVarlen.apply(*stream, sinks, cu, longest, window, options)
        return out.view(*q.shape[:-1], v.shape[-1])

    def _segment(self, segment: Segment, q, k, v, sinks) -> torch.Tensor:
        length, window = segment.length, self.window
        if segment.mask is not None:  # a pack of short documents: its own mask, within the window
            visible = segment.mask if window is None else segment.mask & band(length, length, 0, window, q.device)
            return sink_attention(q, k, v, sinks, additive(visible, q.dtype), self.scale)
        if window is None or length <= window:
            return sink_attention(q, k, v, sinks, None, self.scale)
        return self._blocks(q, k, v, sinks)

    def _blocks(self, q, k, v, sinks) -> torch.Tensor:
        """Documents longer than the window, in query blocks of W (the module docstring)."""
        count, length = q.shape[:2]
        window = self.window
        blocks = -(-length // window)
        padding = blocks * window - length  # padded queries are cut off; padded keys are after every real query
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padding)).unflatten(1, (blocks, window)) for t in (q, k, v))
        first = sink_attention(q[:, 0], k[:, 0], v[:, 0], sinks, None, self.scale)
        later_k, later_v = (torch.cat((t[:, :-1], t[:, 1:]), dim=2).flatten(0, 1) for t in (k, v))
        mask = additive(band(window, 2 * window, window, window, q.device), q.dtype)
        later = sink_attention(q[:, 1:].flatten(0, 1), later_k, later_v, sinks, mask, self.scale)
        out = torch.cat((first.unsqueeze(1), later.unflatten(0, (count, blocks - 1))), dim=1)
        return out.flatten(1, 2)[:, :length]


def layer_window(cfg: ModelShape, layer: int) -> int | None:
    """The window of block `layer`: gpt-oss's even blocks slide, the odd ones attend fully."""
    return cfg.options.sliding_window if layer % 2 == 0 else None


def gpt_oss_attention(cfg: ModelShape, layer: int) -> Attention:
    """Block `layer`'s attention: the shared GQA `Attention` with biases on q, k, v and o, YaRN, one
    sink per head and the sink/window core of its block."""
    o = cfg.options
    return Attention(cfg, qkv_bias=o.attention_bias, o_bias=o.attention_bias, rope=o, sinks=True,
                     core=SinkWindowCore(layer_window(cfg, layer)))
