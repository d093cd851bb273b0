"""The memory tooling: the transient-peak tracker and the offload store's byte count."""

import torch

from mop.testing.memory import PeakMemory
from mop.models.config import ModelConfig
from mop.models.transformer import build_model
from mop.parallel.checkpointing import apply_activation_checkpointing

CPU = torch.device("cpu")
MB = 4 * 250_000  # bytes of a 250k-element fp32 tensor


def test_peak_counts_new_tensors_while_they_live():
    existing = torch.randn(250_000)
    with PeakMemory(CPU) as memory:
        a = existing * 2
        b = a + 1  # a and b alive: 2 MB
        del a
        c = b * 3  # b and c alive: 2 MB again
        del b, c
        d = torch.empty(750_000)  # 3 MB
        del d
    assert memory.peak_bytes == 3 * MB


def test_views_and_in_place_ops_of_existing_tensors_cost_nothing():
    existing = torch.randn(250_000)
    with PeakMemory(CPU) as memory:
        existing.add_(1)
        view = existing.view(500, 500)[:10]
        del view
    assert memory.peak_bytes == 0


def test_storage_empty_at_entry_counts_while_it_is_resized():
    """FSDP2's unsharded parameters: their storage exists at entry, freed (size 0), and is resized
    in place for each all-gather; the tracker counts it while it holds bytes."""
    gathered = torch.empty(250_000)
    gathered.untyped_storage().resize_(0)
    source = torch.randn(250_000)
    with PeakMemory(CPU) as memory:
        gathered.untyped_storage().resize_(MB)  # FSDP2's alloc_storage before the all-gather
        gathered.copy_(source)  # the copy-out: 1 MB live
        small = source[:125_000] * 2  # 0.5 MB beside it: 1.5 MB
        del small
        gathered.untyped_storage().resize_(0)  # resharded after use
        after = torch.cat([source, source[:125_000]])  # 1.25 MB alone: below the peak
        del after
    assert memory.peak_bytes == MB + MB // 2


def test_excluded_bytes_are_not_counted():
    excluded = [0]
    with PeakMemory(CPU, exclude=lambda: excluded[0]) as memory:
        excluded[0] += MB  # announced before it is allocated, as the offload store does
        held = torch.empty(250_000)
        other = torch.empty(250_000)
    assert memory.peak_bytes == MB
    del held, other


def test_offload_store_holds_the_block_inputs_until_the_backward():
    cfg = ModelConfig(vocab_size=50, hidden=16, layers=3, heads=2, kv_heads=1, head_dim=8, experts=2, top_k=1,
                      expert_intermediate=8)
    model = build_model(cfg, seed=0)
    store = apply_activation_checkpointing(model, offload=True, pin_memory=False)
    ids = torch.randint(0, 50, (2, 12))
    positions = torch.arange(12).expand(2, 12)
    loss = model(ids, ids, position_ids=positions)
    residual = 2 * 12 * cfg.hidden * 4
    assert store.live_bytes == cfg.layers * (residual + positions.numel() * 8)
    loss.backward()
    del loss
    assert store.live_bytes == 0 and store.peak_bytes == cfg.layers * (residual + positions.numel() * 8)
