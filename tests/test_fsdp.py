"""FSDP2 over the world mesh against the single-process model: losses and every gradient.

Each rank takes its contiguous share of one batch; with the objective normalised by the global
target count and gradients SUM-reduced, the gathered gradient must equal the gradient of the
full-batch loss computed in one process.
"""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.transformer import IGNORE_INDEX, build_model
from mop.parallel import DistLayout, Layout
from mop.parallel.fsdp import shard_dense
from mop.testing import run_distributed

CFG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2,
                  expert_intermediate=16, dense_layers=1, dense_intermediate=24, shared_expert_intermediate=8)


def batch(sequences=4, seq=12):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, CFG.vocab_size, (sequences, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[1, :7] = IGNORE_INDEX
    document_ids = (torch.arange(seq) >= 5).long().expand(sequences, seq).clone()
    return ids[:, :-1], labels, document_ids


def sharded_step(rank, world, cfg):
    model = build_model(cfg, seed=3)
    shard_dense(model, DistLayout(Layout(world), torch.device("cpu")))
    ids, labels, document_ids = batch()
    share = ids.shape[0] // world
    mine = slice(rank * share, (rank + 1) * share)
    targets = int((labels != IGNORE_INDEX).sum())
    terms = model.loss_terms(ids[mine], labels[mine], document_ids=document_ids[mine])
    loss = model.objective(terms, targets, ids.shape[0])
    loss.backward()
    local_loss = torch.tensor([loss.item()])
    torch.distributed.all_reduce(local_loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return local_loss.item(), grads


@pytest.mark.parametrize("world, tied", [pytest.param(2, False, marks=pytest.mark.slow), pytest.param(4, False, marks=pytest.mark.slow), (2, True)])
def test_fsdp_matches_the_single_process_gradients(world, tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    model = build_model(cfg, seed=3)
    ids, labels, document_ids = batch()
    loss = model(ids, labels, document_ids=document_ids)
    loss.backward()
    for rank_loss, grads in run_distributed(sharded_step, world, cfg):
        assert_close(torch.tensor(rank_loss), loss.detach(), atol=1e-6, rtol=1e-6)
        for name, param in model.named_parameters():
            assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5, msg=name)
