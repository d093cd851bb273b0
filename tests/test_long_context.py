"""Long packed-document context: O(S) attention memory, no third recomputation under activation
checkpointing, and `mop train` on packed documents matching the reference on 2 and 4 ranks."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import mop.models.attention
import mop.parallel.llep_chunked
from mop.config import load_config
from mop.data import build_data
from mop.models.attention import Attention
from mop.models.config import ModelConfig
from mop.models.documents import PACK_TOKENS, Documents
from mop.models.transformer import IGNORE_INDEX, build_model, document_positions
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import canonical_name
from mop.parallel.parallelize import parallelize
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.memory import PeakMemory
from mop.train import forward_backward
from test_train import losses, run


def document_lengths(total: int, seed: int) -> list[int]:
    """Documents of 128 to 600 tokens, half of them followed by a run of very short ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(128, 600, (1,), generator=g)))
        if torch.rand(1, generator=g) < 0.5:
            lengths += torch.randint(1, 16, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
    cut, left = [], total
    for n in lengths:
        if left:
            cut.append(min(n, left))
            left -= cut[-1]
    return cut


def test_attention_memory_is_linear_in_context():
    """One attention layer, forward and backward, at S = 32K: an [S, S] tensor of even one byte per
    element (1 GiB) cannot fit under the O(S) peak bound; and the sum of every allocation is O(S)
    too, which a cost per segment and token cannot meet (one q-sized tensor per segment would be
    over 100 x 8 MiB)."""
    seq = 32768
    cfg = ModelConfig(hidden=64, heads=4, kv_heads=2, head_dim=16)
    attention = Attention(cfg)
    lengths = document_lengths(seq, seed=0)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    x = torch.randn(1, seq, cfg.hidden, requires_grad=True)
    positions = document_positions(ids)
    with PeakMemory(torch.device("cpu")) as memory:
        documents = Documents.from_ids(ids)
        out = attention(x, positions, documents)
        out.sum().backward()
    assert len(documents.segments) > 100 and any(s.mask is not None for s in documents.segments)
    # Per token: the layer's input and its q, k, v (fp32), eight times over (projections, norms,
    # RoPE, output and their gradients), plus at most one pack-mask byte per packed token pair.
    per_token = 8 * 4 * (cfg.hidden + (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim) + PACK_TOKENS
    bound = seq * per_token
    assert bound < seq * seq // 4
    assert memory.peak_bytes < bound, f"peak {memory.peak_bytes / 2**20:.0f} MiB over the O(S) bound"
    assert memory.allocated_bytes < 4 * bound, f"{memory.allocated_bytes / 2**20:.0f} MiB allocated in all"
    assert x.grad is not None and torch.isfinite(x.grad).all()


MODEL = ["--model.vocab_size=64", "--model.hidden=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2",
         "--model.head_dim=8", "--model.experts=4", "--model.expert_intermediate=16", "--data.seq_len=64"]
CHUNKED = ["--parallel.strategy=mop", "--parallel.nproc=2", "--parallel.sequence=2", "--parallel.expert=2",
           "--parallel.vocab=1", "--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4",
           "--parallel.llep_gate=1.0", "--parallel.llep_chunks=2", "--parallel.attention_head_chunks=2",
           "--optim.offload=false", "--train.global_batch=2", "--train.micro_batch=1"]


def packed_batch(seq: int) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, seq + 1), generator=g)
    documents = torch.repeat_interleave(torch.arange(5), torch.tensor([5, 30, 1, 20, 8])).unsqueeze(0)
    labels = ids[:, 1:].clone()
    labels[0, 4] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": document_positions(documents),
            "document_ids": documents}


def _count_passes(rank, world, extra):
    """One micro-batch's forward and backward, counting the attention kernel and expert-chunk calls."""
    config = settle(load_config(None, [*MODEL, *CHUNKED, *extra]), world, fit_memory=False)
    counts = {"attention": 0, "expert chunks": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    mop.models.attention.document_attention = counted("attention", mop.models.attention.document_attention)
    mop.parallel.llep_chunked.expert_outputs = counted("expert chunks", mop.parallel.llep_chunked.expert_outputs)
    mop.parallel.llep_chunked.grouped_expert_outputs = counted("expert chunks",
                                                               mop.parallel.llep_chunked.grouped_expert_outputs)
    layout = DistLayout(Layout(world, 2, 2, 1), torch.device("cpu"))
    model = parallelize(build_model(config.model, seed=4), layout, config)
    batch = packed_batch(config.data.seq_len)
    tokens = config.data.seq_len // world
    mine = {k: v[:, rank * tokens:(rank + 1) * tokens] for k, v in batch.items()}
    forward_backward(model, [mine], NextTokenLoss(model, int((batch["labels"] != IGNORE_INDEX).sum()), 1),
                     Runtime(rank, world, layout.device, layout))
    grads = {canonical_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters()}
    store = model.activation_offload if hasattr(model, "activation_offload") else None
    return counts, grads, None if store is None else (store.peak_bytes, store.live_bytes)


@pytest.mark.parametrize("checkpointing", [pytest.param(["--train.activation_checkpointing=full"], marks=pytest.mark.slow),
                                           ["--train.activation_checkpointing=full",
                                            "--train.offload_activations=true"]])
def test_checkpointed_blocks_do_not_run_chunked_parts_a_third_time(checkpointing):
    """Head-chunked attention and chunked LLEP recompute themselves in their backward; a checkpointed
    block hands them their forward outputs in its recomputation, so each still runs exactly twice
    (forward, backward), as without checkpointing, and the gradients are the same."""
    plain = run_distributed(_count_passes, 2, [])
    checkpointed = run_distributed(_count_passes, 2, checkpointing)
    layers, chunks = 2, 2
    for (counts, grads, _), (counts_ac, grads_ac, offloaded) in zip(plain, checkpointed):
        assert counts == {"attention": 2 * layers * chunks, "expert chunks": 2 * layers * chunks}
        assert counts_ac == counts
        if offloaded is not None:
            # Each block's input [1, 32, 32] plus its kept attention output ([1, 32, 32]) were in
            # host memory at once (chunked LLEP keeps no output: its recomputation returns a
            # placeholder), and all of it was released by the backward.
            peak, live = offloaded
            assert layers * 2 * 32 * 32 * 4 <= peak < layers * 3 * 32 * 32 * 4 and live == 0
        for name, grad in grads.items():
            assert_close(grads_ac[name], grad, atol=1e-6, rtol=1e-6, msg=name)


def mixed_document_corpus(path) -> str:
    """A text corpus of documents of 1 to 300 bytes, so that 256-token sequences hold both short
    documents (packed under a mask) and long ones (causal on their own span)."""
    g = torch.Generator().manual_seed(11)
    letters = "abcdefghij klmnopqrstuvwxyz"
    sizes = [int(n) for n in torch.randint(1, 300, (300,), generator=g)]
    sizes = [n if torch.rand(1, generator=g) < 0.5 else max(1, n // 20) for n in sizes]
    docs = ["".join(letters[i] for i in torch.randint(0, len(letters), (n,), generator=g).tolist()).strip() or "x"
            for n in sizes]
    path.write_text("\n\n".join(docs) + "\n")
    return str(path)


PACKED = ["--data.seq_len=256", "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8",
          "--train.micro_batch=1"]


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [
    (2, ["--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2", "--parallel.attention_head_chunks=2",
         "--parallel.llep_chunks=2", "--train.activation_checkpointing=full", "--train.offload_activations=true",
         "--optim.offload=true"]),
    (4, ["--parallel.sequence=4", "--parallel.expert=2", "--parallel.vocab=2", "--optim.offload=false"]),
])
def test_packed_documents_train_like_the_reference(tmp_path, world, layout):
    corpus = mixed_document_corpus(tmp_path / "mixed.txt")
    data = build_data(corpus, "byte", 256, seed=0)
    segments = [s for i in range(len(data.dataset)) for s in Documents.from_ids(data.dataset[i]["document_ids"][None]).segments]
    assert any(s.mask is not None for s in segments) and any(s.mask is None and s.length >= 128 for s in segments)
    reference = run(tmp_path, "reference", *PACKED, f"--data.source={corpus}")
    records = run(tmp_path, f"mop{world}", *PACKED, f"--data.source={corpus}", "--parallel.strategy=mop",
                  f"--parallel.nproc={world}", "--parallel.expert_balance=llep", "--parallel.llep_min_chunk=4",
                  "--parallel.llep_gate=1.0", *layout)
    assert losses(records) == pytest.approx(losses(reference), rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-5)
