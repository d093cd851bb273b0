"""The whole model under the `mop` dense path (FSDP2 + Ulysses, checkpointing, offload) against the
single-process model on the same global batch: the loss and every parameter gradient.

Each rank takes its data group's share of the batch and its slice of every sequence, exactly as
the trainer does (`group_slice`, `sequence_shard`, `NextTokenLoss`).
"""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from mop.config import Config, load_config
from mop.data import group_slice, sequence_shard
from mop.models.transformer import IGNORE_INDEX, build_model, document_positions
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import canonical_name
from mop.parallel.parallelize import apply_memory_options, parallelize
from mop.settle import settle
from mop.testing import run_distributed

MODEL = ["--model.vocab_size=64", "--model.hidden=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2",
         "--model.head_dim=8", "--model.experts=4", "--model.expert_intermediate=16", "--model.dense_layers=1",
         "--model.dense_intermediate=24", "--data.seq_len=16"]
GLOBAL_BATCH = 4


def make_config(world, *extra) -> Config:
    """The dense path alone: the other techniques explicitly off, `extra` switches what is tested on."""
    return settle(load_config(None, [*MODEL, "--parallel.strategy=mop", f"--parallel.nproc={world}",
                                       "--parallel.sequence=1", "--parallel.expert=1", "--parallel.vocab=1",
                                       "--optim.offload=false", f"--train.global_batch={GLOBAL_BATCH}",
                                       "--train.micro_batch=1", *extra]), world, fit_memory=False)


def global_batch(seq_len):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (GLOBAL_BATCH, seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[2, :9] = IGNORE_INDEX
    documents = torch.zeros(GLOBAL_BATCH, seq_len, dtype=torch.long)
    documents[:, 6:] += 1
    documents[1, 11:] += 1
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": document_positions(documents),
            "document_ids": documents}


def reference_gradients(config: Config):
    model = build_model(config.model, seed=9)
    apply_memory_options(model, config, torch.device("cpu"))
    batch = global_batch(config.data.seq_len)
    targets = int((batch["labels"] != IGNORE_INDEX).sum())
    loss, _, _ = NextTokenLoss(model, targets, GLOBAL_BATCH)(batch)
    loss.backward()
    return loss.item(), {canonical_name(name): p.grad for name, p in model.named_parameters()}


def mop_gradients(rank, world, config: Config):
    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    model = parallelize(build_model(config.model, seed=9), layout, config)
    batch = global_batch(config.data.seq_len)
    targets = int((batch["labels"] != IGNORE_INDEX).sum())
    rows = group_slice(list(range(GLOBAL_BATCH)), rank // p.sequence, world // p.sequence)
    total = torch.zeros(())
    for row in rows:  # micro-batches of one sequence, gradients accumulate
        micro = sequence_shard({k: v[row:row + 1] for k, v in batch.items()}, rank % p.sequence, p.sequence)
        loss, _, _ = NextTokenLoss(model, targets, GLOBAL_BATCH)(micro)
        loss.backward()
        total += loss.detach()
    torch.distributed.all_reduce(total)
    return total.item(), {canonical_name(name): param.grad.full_tensor() for name, param in model.named_parameters()}


LAYOUTS = [
    (2, ["--parallel.sequence=2"]),
    (2, ["--parallel.sequence=2", "--parallel.attention_head_chunks=2", "--train.activation_checkpointing=full"]),
    (2, ["--parallel.sequence=2", "--train.activation_checkpointing=full", "--train.offload_activations=true"]),
    (4, ["--parallel.sequence=2"]),
    (4, ["--parallel.sequence=4", "--train.activation_checkpointing=full"]),
    (4, ["--parallel.sequence=1", "--train.activation_checkpointing=full", "--train.offload_activations=true"]),
]


@pytest.mark.parametrize("world, extra", [pytest.param(w, e, id=" ".join(e) + f" W={w}", marks=pytest.mark.slow if i else ())
                                          for i, (w, e) in enumerate(LAYOUTS)])
def test_mop_dense_path_matches_the_reference(world, extra):
    config = make_config(world, *extra)
    reference_config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, sequence=1))
    loss, grads = reference_gradients(reference_config)
    for rank_loss, rank_grads in run_distributed(mop_gradients, world, config):
        assert_close(torch.tensor(rank_loss), torch.tensor(loss), atol=1e-6, rtol=1e-6)
        assert rank_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert_close(rank_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_and_offload_leave_the_reference_unchanged():
    plain = reference_gradients(make_config(1, "--parallel.strategy=reference"))
    for extra in (["--train.activation_checkpointing=full"],
                  ["--train.activation_checkpointing=full", "--train.offload_activations=true"]):
        loss, grads = reference_gradients(make_config(1, "--parallel.strategy=reference", *extra))
        assert loss == plain[0]
        for name, grad in grads.items():
            assert torch.equal(grad, plain[1][name]), name
