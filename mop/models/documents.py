"""Causal attention over packed documents without an `[S, S]` tensor, on CPU and CUDA.

A micro-batch of B rows of S tokens is seen as one stream of B*S tokens cut into documents: a
document never crosses a row, and a row is cut wherever its document id changes (the packer's ids
are non-decreasing along a row). `Documents.from_ids` derives that cut once per micro-batch from
the `[B, S]` document ids (one host copy of the ids and a few vectorised O(B*S) host ops, then
O(documents) host work), and every layer and head chunk reuses it. A micro-batch whose every row
holds a single document has no `Documents` (None): attention is plain causal SDPA with
`is_causal`, no mask.

Kernels (`document_attention`, one entry point that picks by device and dtype):
- CUDA in bf16/fp16 (the inputs' dtype, or autocast's when it is on, since that is what SDPA would
  compute in): `torch.nn.attention.varlen.varlen_attn` (flash attention over cumulative document
  lengths, causal) on the flattened stream, where flash applies (Ampere or newer, head dim a
  multiple of 8 up to 256). GQA without repeating K/V where `varlen_attn` takes `enable_gqa`
  (torch 2.13+); on a torch without it (2.11) K/V are repeated to the query heads first (exact;
  costs one K and one V of the query heads' width per call, a head chunk's under Ulysses).
- Everywhere else (CPU; fp32 on CUDA): SDPA per segment of the stream, from `Documents.segments`:
  * a run of consecutive documents of equal length L is one batched `is_causal` SDPA call on the
    `[n, L]` view of the stream (no copy), so a whole row of one document, or equal-length
    documents, costs one call;
  * consecutive documents shorter than `SHORT_DOCUMENT` tokens are packed into groups of at most
    `PACK_TOKENS` tokens, each one SDPA call with its own `[g, g]` block-diagonal causal mask
    (g <= PACK_TOKENS), so a stream of tiny documents does not cost one call per document.
  The segments' outputs are concatenated in stream order. GQA goes through SDPA's `enable_gqa`,
  which the CPU flash kernel serves without repeating K/V in memory.
FlexAttention was considered for CUDA and not built: it has no backward on CPU (torch 2.13), so
it could not be tested here, and varlen_attn needs no compilation. The segment path is the
fallback on CUDA (fp32, pre-Ampere GPUs, other head dims, a torch without varlen_attn).

Memory per call, for T = B*S tokens, h query heads, kv key/value heads, head dim d: the output
and the softmax statistics (O(T h d)); the pack masks (at most PACK_TOKENS bytes per token, built
once per micro-batch at first use by the segment kernel and shared by every layer); no `[S, S]`
tensor. Time follows the sum of the squared document lengths (plus at most PACK_TOKENS per token
for the packs), not S^2.

Branches (a DPO pair's second response, which shares its prompt with the first: issue 39). A
document may also attend, in full, to the first `prefix` tokens of the document before it in the
stream (`Documents.prefixes`, from the per-token `prefix_lengths`), as if those tokens preceded its
own. Its queries attend to `[prefix ; itself]`, causal within itself and bottom-right aligned:
query i sees the prefix and its own tokens 0..i. The segment kernel computes a branch in blocks
of at most `BRANCH_BLOCK` queries, each one SDPA call over the keys it sees with its own
`[block, prefix + seen]` mask (no `[S, S]` tensor: O(block x (prefix + length)) bytes per call);
the prefixes' keys and values come from one gather over the stream for all branches (its
backward is one index_add, not one stream-sized gradient per branch). A micro-batch with branches
takes the segment kernel on every device: the flash varlen path for branches (separate query and
key offsets over a gathered key stream) is not built yet.

Invariant: every query attends exactly to the keys of its own document at positions <= its own,
and a branch's queries also to its prefix, as the dense mask `causal & same_document` (with the
prefix rows added) would say (the tests' oracle).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.layers import compute_dtype_of


@cache
def _varlen_kernel():
    """torch's flash varlen attention, imported on first use on a GPU (importing it loads
    torch._dynamo, about a second on every process otherwise); None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@cache
def _varlen_takes(argument: str) -> bool:
    """Whether `varlen_attn` takes `argument`: `enable_gqa` (torch 2.13 does, 2.11 does not: there
    K/V are repeated to the query heads before the call), `scale` (without it the queries are
    scaled by scale x sqrt(d) first, which the kernel's 1/sqrt(d) turns into `scale`)."""
    return argument in inspect.signature(_varlen_kernel()).parameters

SHORT_DOCUMENT = 128  # documents shorter than this are packed with their neighbours...
PACK_TOKENS = 256  # ...into groups of at most this many tokens, one masked SDPA call each
BRANCH_BLOCK = 256  # a branch's queries per masked SDPA call


@dataclass(frozen=True)
class Segment:
    """`count` consecutive documents of `length` tokens each; with a `mask`, one group of several
    short documents (count 1) attended under that mask. A micro-batch's segments tile its stream
    in order."""

    count: int
    length: int
    mask: torch.Tensor | None = None
    prefix: int = 0
    """A branch (count 1): it also attends to this many tokens of the document before it."""


class Documents:
    """The documents of one micro-batch, as spans of its flattened `[B*S]` token stream.

    A plain class, not a dataclass: FSDP2 rebuilds the dataclasses among a unit's inputs (to cast
    their tensors) on every call, which would redo this object's O(documents) fields per block.
    """

    def __init__(self, lengths: tuple[int, ...], cu_seqlens: torch.Tensor, prefixes: tuple[int, ...] = ()):
        self.lengths = lengths
        """Document lengths in stream order (each row's sum to S)."""
        self.cu_seqlens = cu_seqlens
        """int32 `[documents + 1]` cumulative lengths on the ids' device (for varlen_attn)."""
        self.max_length = max(lengths)
        self.prefixes = prefixes
        """Per document, the leading tokens of the document before it that it also attends to (0:
        none; empty: no branches); see the module docstring."""

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The SDPA calls of the segment kernel (see the module docstring), planned at first use:
        the varlen kernel never needs them."""
        return plan_segments(self.lengths, self.cu_seqlens.device, self.prefixes)

    @cached_property
    def prefix_index(self) -> torch.Tensor:
        """Stream positions of every branch's prefix, branch after branch: one gather serves them all."""
        starts = self.cu_seqlens.tolist()
        parts = [torch.arange(starts[d - 1], starts[d - 1] + prefix)
                 for d, prefix in enumerate(self.prefixes) if prefix]
        return torch.cat(parts).to(self.cu_seqlens.device)

    @staticmethod
    def from_ids(document_ids: torch.Tensor, prefix_lengths: torch.Tensor | None = None) -> Documents | None:
        """The documents of `document_ids [B, S]`; None when every row is a single document.
        `prefix_lengths [B, S]` (None: no branches): on each token of a branch, how many leading
        tokens of the document before it the branch attends to (0 elsewhere)."""
        ids = document_ids.detach().cpu()
        rows, seq = ids.shape
        change = ids[:, 1:] != ids[:, :-1]
        if not bool(change.any()):
            return None
        if bool((ids[:, 1:] < ids[:, :-1]).any()):
            raise ValueError("document ids must be non-decreasing along each row (a change starts a new document)")
        starts = torch.ones(rows, seq, dtype=torch.bool)
        starts[:, 1:] = change
        first = starts.flatten().nonzero().squeeze(1)
        bounds = torch.cat([first, torch.tensor([rows * seq])])
        lengths = tuple(bounds.diff().tolist())
        prefixes = () if prefix_lengths is None else _prefixes(prefix_lengths.detach().cpu().flatten(), first,
                                                                  lengths, seq)
        return Documents(lengths, bounds.to(device=document_ids.device, dtype=torch.int32), prefixes)


def _prefixes(per_token: torch.Tensor, first: torch.Tensor, lengths: tuple[int, ...], seq: int) -> tuple[int, ...]:
    """Each document's prefix length from the per-token `prefix_lengths`, checked: constant over the
    document, and only where the document before it lies in the same row and is that long."""
    prefixes = tuple(per_token[first].tolist())
    if not any(prefixes):
        return ()
    for d, (start, prefix) in enumerate(zip(first.tolist(), prefixes)):
        if bool((per_token[start:start + lengths[d]] != prefix).any()):
            raise ValueError("prefix lengths must be constant over each document")
        if prefix and (start % seq == 0 or lengths[d - 1] < prefix or prefix < 0):
            raise ValueError(f"the document at stream position {start} attends to {prefix} tokens of the one "
                             "before it, which its row does not hold")
    return prefixes


def plan_segments(lengths: tuple[int, ...], device: torch.device,
                  prefixes: tuple[int, ...] = ()) -> tuple[Segment, ...]:
    """Runs of equal-length documents and packs of short ones, in stream order; a branch (a
    nonzero prefix) is a segment of its own."""
    segments: list[Segment] = []
    pack: list[int] = []

    def close_pack():
        if len(pack) > 1:
            segments.append(Segment(1, sum(pack), pack_mask(pack, device)))
        elif pack:
            segments.append(Segment(1, pack[0]))
        pack.clear()

    packed = 0  # tokens in `pack`
    for index, length in enumerate(lengths):
        prefix = prefixes[index] if prefixes else 0
        if prefix:
            close_pack()
            packed = 0
            segments.append(Segment(1, length, prefix=prefix))
            continue
        if length < SHORT_DOCUMENT:
            if packed + length > PACK_TOKENS:
                close_pack()
                packed = 0
            pack.append(length)
            packed += length
            continue
        close_pack()
        packed = 0
        last = segments[-1] if segments else None
        if last is not None and last.mask is None and not last.prefix and last.length == length:
            segments[-1] = Segment(last.count + 1, length)
        else:
            segments.append(Segment(1, length))
    close_pack()
    return tuple(segments)


def pack_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Boolean `[g, g]` mask of a pack of documents: causal within each, nothing across."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    size = ids.numel()
    causal = torch.ones(size, size, dtype=torch.bool).tril_()
    return (causal & (ids[:, None] == ids[None, :])).to(device)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None,
                       scale: float | None = None) -> torch.Tensor:
    """Causal attention of `q [B, S, h, d]` over `k [B, S, kv, d]`, `v [B, S, kv, dv]` within each
    document, scores scaled by `scale` (None: 1/sqrt(d)); the output is `[B, S, h, dv]`. The flash
    kernel wants one width: values narrower than q and k (multi-head latent attention) are padded
    with zero columns to it and the output's padding cut off (exact: a zero column of V gives a zero
    output column and no gradient to the others); wider ones take the segment path."""
    gqa = q.shape[2] != k.shape[2]
    if documents is None:
        return _sdpa(q, k, v, is_causal=True, gqa=gqa, scale=scale)
    dtype = varlen_dtype(q) if not documents.prefixes else None  # branches: the segment kernel (docstring)
    width = v.shape[-1]
    if dtype is not None and width <= q.shape[-1]:
        padded = F.pad(v, (0, q.shape[-1] - width)) if width < q.shape[-1] else v
        out = _varlen(q.to(dtype), k.to(dtype), padded.to(dtype), documents, gqa, scale)
        return out[..., :width] if width < q.shape[-1] else out
    return _segments(q, k, v, documents, gqa, scale)


def varlen_dtype(q: torch.Tensor) -> torch.dtype | None:
    """The dtype flash varlen attention runs `q` in, or None where it does not apply: the dtype SDPA
    would compute in (autocast's, when autocast is on, as it is for the reference's fp32 weights)
    must be bf16/fp16, the GPU Ampere or newer and the head dim a multiple of 8 up to 256."""
    if not q.is_cuda or _varlen_kernel() is None:
        return None
    dtype = compute_dtype_of(q)
    head_dim = q.shape[-1]
    if dtype not in (torch.bfloat16, torch.float16) or head_dim % 8 or head_dim > 256:
        return None
    return dtype if torch.cuda.get_device_capability(q.device) >= (8, 0) else None


def _sdpa(q, k, v, is_causal: bool, gqa: bool, mask: torch.Tensor | None = None, scale: float | None = None):
    """SDPA on `[n, L, heads, d]` tensors, in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=is_causal, enable_gqa=gqa, scale=scale)
    return out.transpose(1, 2)


def _segments(q, k, v, documents: Documents, gqa: bool, scale: float | None) -> torch.Tensor:
    # The segments tile the stream in order: one split per tensor (whose backward is one
    # concatenation), not a slice per segment (whose backward would pad each gradient to the
    # whole stream: O(segments x S)).
    sizes = [s.count * s.length for s in documents.segments]
    pieces = [t.reshape(-1, *t.shape[2:]).split(sizes) for t in (q, k, v)]  # of [B*S, heads, d]
    if documents.prefixes:
        index = documents.prefix_index
        branches = [s.prefix for s in documents.segments if s.prefix]
        prefixes = iter(zip(*(t.reshape(-1, *t.shape[2:]).index_select(0, index).split(branches) for t in (k, v))))
    outputs = []
    for s, q_s, k_s, v_s in zip(documents.segments, *pieces):
        if s.prefix:
            outputs.append(_branch(q_s, k_s, v_s, *next(prefixes), gqa, scale))
            continue
        shape = (s.count, s.length)
        out = _sdpa(q_s.unflatten(0, shape), k_s.unflatten(0, shape), v_s.unflatten(0, shape),
                    is_causal=s.mask is None, gqa=gqa, mask=s.mask, scale=scale)
        outputs.append(out.flatten(0, 1))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.reshape(*q.shape[:-1], v.shape[-1])


def _branch(q, k, v, prefix_k, prefix_v, gqa: bool, scale: float | None) -> torch.Tensor:
    """A branch's `q [L, h, d]` over `[prefix ; itself]`, bottom-right causal, in blocks of queries."""
    prefix, length = prefix_k.shape[0], q.shape[0]
    keys, values = torch.cat([prefix_k, k]), torch.cat([prefix_v, v])
    outputs = []
    for start in range(0, length, BRANCH_BLOCK):
        end = min(start + BRANCH_BLOCK, length)
        seen = prefix + end  # the keys of this block's last query
        mask = torch.arange(seen, device=q.device) < prefix + torch.arange(start, end, device=q.device)[:, None] + 1
        outputs.append(_sdpa(q[None, start:end], keys[None, :seen], values[None, :seen], is_causal=False, gqa=gqa,
                             mask=mask, scale=scale)[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _varlen(q, k, v, documents: Documents, gqa: bool, scale: float | None) -> torch.Tensor:
    stream = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu, longest = documents.cu_seqlens, documents.max_length
    stream, options = varlen_operands(*stream, gqa, scale, _varlen_takes)
    out = _varlen_kernel()(*stream, cu, cu, longest, longest, window_size=(-1, 0), **options)
    return out.view(q.shape)


def varlen_operands(q, k, v, gqa: bool, scale: float | None, takes: Callable[[str], bool]):
    """The stream's `q [T, h, d]`, `k`, `v [T, kv, d]` and the keyword options of a flash varlen
    call whose kernel takes the arguments `takes` says it does (`varlen_attn` here, its op in
    gpt_oss): `scale` passed where taken, else folded into q; GQA through `enable_gqa` where taken,
    else K/V repeated to the query heads (see `_varlen_takes`). Returns `([q, k, v], options)`."""
    options = {}
    if scale is not None and takes("scale"):
        options["scale"] = scale
    elif scale is not None:
        q = q * (scale * q.shape[-1] ** 0.5)
    if gqa and takes("enable_gqa"):
        options["enable_gqa"] = True
    elif gqa:  # each K/V head serves heads/kv consecutive query heads, as SDPA's enable_gqa groups them
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return [q, k, v], options


class DocumentBoundaries(nn.Module):
    """The model's seam from a micro-batch's document ids to its `Documents`, called once per forward.

    Sequence parallelism swaps it for one that first gathers the ids of whole sequences
    (`mop.parallel.ulysses.SequenceDocumentBoundaries`).
    """

    def forward(self, document_ids: torch.Tensor | None,
                prefix_lengths: torch.Tensor | None = None) -> Documents | None:
        return None if document_ids is None else Documents.from_ids(document_ids, prefix_lengths)
