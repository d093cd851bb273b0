"""`mop bench attention`: per-rank activation memory and time of the dense path against sequence length.

Part 1, forward + backward of three nested pieces: the attention core alone (the sequence-mixing
step Ulysses replaces: exchange, SDPA, exchange back), the attention layer (projections, norms,
RoPE and the core) and one transformer block (attention + MoE); for D=1 (one rank, the reference
core), D=2 plain Ulysses, D=2 Ulysses in head chunks.
Part 2, the whole model (embedding, blocks, loss), forward + backward, at one sequence length, for
    no activation checkpointing, full checkpointing, and full checkpointing with host offload,
    at D=1 and D=2.

Data: the first sequence of the shipped corpus packed as `mop train` packs it, with its document
boundaries (`--documents single`: the same tokens as one document). Memory is the peak of the
tensors created during forward + backward on each rank (parameters, inputs and pre-allocated
gradients excluded; see `mop.testing.memory`), reported per rank (the max
over ranks). With offload, the host copies are reported separately and not counted in the
per-rank peak: on a GPU they live in host memory. Time is the mean wall time of forward +
backward after one warm-up, max over ranks. Ranks get one intra-op thread each, so D=1 and D=2
compare per-rank work on equal cores. Ratios are against D=1 (part 1) and against no
checkpointing at the same D (part 2) in the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mop.bench.report import MIB, table, write_json
from mop.bench.shape import add_shape_arguments
from mop.data import build_data, sequence_shard
from mop.models.config import ModelConfig
from mop.models.documents import Documents
from mop.models.transformer import Block, IGNORE_INDEX, build_model, init_weights
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import apply_activation_checkpointing
from mop.parallel.ulysses import UlyssesAttention, apply_sequence_parallel
from mop.testing import run_distributed
from mop.testing.memory import measure_step, preallocate_grads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192", help="block sequence lengths, comma-separated")
    parser.add_argument("--model-seq-len", type=int, default=4096, help="sequence length of the whole-model part")
    add_shape_arguments(parser, hidden=256, heads=8, kv_heads=2, head_dim=32, layers=4)  # layers: the whole-model part
    parser.add_argument("--head-chunks", type=int, default=4, help="head chunks of the chunked Ulysses variant")
    parser.add_argument("--repeats", type=int, default=2, help="timed forward+backward passes after a warm-up")
    parser.add_argument("--documents", choices=["packed", "single"], default="packed",
                        help="packed: the shipped corpus's packed documents, as mop train reads them; "
                             "single: the same tokens as one document per sequence")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/attention.json"))


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=259, hidden=args.hidden, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, experts=8, top_k=2, expert_intermediate=args.hidden)


def corpus_sequence(seq_len: int, documents: str) -> dict:
    """The first packed sequence of the shipped corpus as a batch of one, as `mop train` reads it;
    "single": its tokens as one document (no document ids, positions 0..S-1)."""
    item = build_data("builtin", "byte", seq_len, seed=0).dataset[0]
    batch = {key: value.unsqueeze(0) for key, value in item.items()}
    if documents == "single":
        batch["document_ids"], batch["position_ids"] = None, torch.arange(seq_len).unsqueeze(0)
    return batch


def layer_rank(rank, world, cfg: ModelConfig, seq_len: int, chunks: int, repeats: int, piece: str,
               documents: str) -> dict:
    block = Block(cfg, layer=0)
    init_weights(block, seed=0, std=cfg.init_std)  # per-name seeds: the same weights on every rank
    if world > 1:
        layout = DistLayout(Layout(world, sequence=world), torch.device("cpu"))
        block.attention.core = UlyssesAttention(layout.sequence_group, cfg.heads, cfg.kv_heads, chunks)
    preallocate_grads(block)
    tokens = seq_len // world
    sequence = sequence_shard(corpus_sequence(seq_len, documents), rank, world)
    full_documents = Documents.from_ids(corpus_sequence(seq_len, documents)["document_ids"]) \
        if documents == "packed" else None
    if piece == "core":
        inputs = [torch.randn(1, tokens, heads, cfg.head_dim, requires_grad=True)
                  for heads in (cfg.heads, cfg.kv_heads, cfg.kv_heads)]
        forward = lambda: block.attention.core(*inputs, full_documents)  # noqa: E731
    else:
        x = torch.randn(1, tokens, cfg.hidden, requires_grad=True)
        layer = block if piece == "block" else block.attention
        forward = lambda: layer(x, sequence["position_ids"], full_documents)  # noqa: E731

    def step():
        out = forward()
        (out[0] if piece == "block" else out).sum().backward()

    return measure_step(step, repeats)


def model_rank(rank, world, cfg: ModelConfig, seq_len: int, checkpointing: bool, offload: bool, repeats: int,
               documents: str) -> dict:
    model = build_model(cfg, seed=0)
    layout = None
    if world > 1:
        layout = DistLayout(Layout(world, sequence=world), torch.device("cpu"))
        apply_sequence_parallel(model, layout.sequence_group, 1)
    store = apply_activation_checkpointing(model, offload, pin_memory=False) if checkpointing else None
    preallocate_grads(model)
    full = corpus_sequence(seq_len, documents)
    batch = sequence_shard(full, rank, world)
    targets = int((full["labels"] != IGNORE_INDEX).sum())

    def step():
        loss, _, _ = NextTokenLoss(model, targets, 1)(batch)
        loss.backward()

    result = measure_step(step, repeats, exclude=(lambda: store.live_bytes) if store else (lambda: 0))
    result["host_bytes"] = store.peak_bytes if store else 0
    return result


def _worst(per_rank: list[dict]) -> dict:
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


def run(args) -> dict:
    cfg = model_config(args)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    variants = [("D=1", 1, 1), ("D=2", 2, 1), (f"D=2 chunks={args.head_chunks}", 2, args.head_chunks)]
    layer_rows = []
    for piece in ("core", "attention", "block"):
        for seq_len in seq_lens:
            base = None
            for name, world, chunks in variants:
                result = _worst(run_distributed(layer_rank, world, cfg, seq_len, chunks, args.repeats, piece,
                                                args.documents, timeout=1800))
                base = base or result
                layer_rows.append({"layer": piece, "seq_len": seq_len,
                                   "variant": name, **result, "peak_vs_d1": result["peak_bytes"] / base["peak_bytes"],
                                   "time_vs_d1": result["seconds"] / base["seconds"]})
    model_rows = []
    for world in (1, 2):
        base = None
        for name, checkpointing, offload in (("none", False, False), ("full", True, False), ("full+offload", True, True)):
            result = _worst(run_distributed(model_rank, world, cfg, args.model_seq_len, checkpointing, offload,
                                            args.repeats, args.documents, timeout=1800))
            base = base or result
            model_rows.append({"D": world, "checkpointing": name, **result,
                               "peak_vs_none": result["peak_bytes"] / base["peak_bytes"],
                               "time_vs_none": result["seconds"] / base["seconds"]})
    return {"documents": args.documents, "layers": layer_rows, "model": model_rows}


def report(args, results: dict) -> None:
    print(table(f"attention core / attention layer / one block (attention + MoE), forward + backward, per rank, "
                f"{args.documents} documents",
                ["layer", "seq_len", "variant", "peak MiB", "vs D=1", "time s", "vs D=1"],
                [[r["layer"], r["seq_len"], r["variant"], r["peak_bytes"] / MIB, r["peak_vs_d1"], r["seconds"],
                  r["time_vs_d1"]] for r in results["layers"]]))
    print()
    print(table(f"whole model ({args.layers} blocks, seq_len {args.model_seq_len}), forward + backward, per rank",
                ["D", "checkpointing", "peak MiB", "vs none", "host MiB", "time s", "vs none"],
                [[r["D"], r["checkpointing"], r["peak_bytes"] / MIB, r["peak_vs_none"], r["host_bytes"] / MIB,
                  r["seconds"], r["time_vs_none"]] for r in results["model"]]))
    path = write_json(args.out, "attention", {k: str(v) for k, v in vars(args).items() if k != "func"}, results)
    print(f"\nresults written to {path}")
