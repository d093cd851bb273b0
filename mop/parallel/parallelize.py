"""`parallelize(model, layout, config)`: apply each technique of the `mop` strategy, in order.

Order (each step touches only the modules it owns; later steps wrap what earlier ones built):
1. Ulysses sequence parallelism swaps every `Attention.core` (when parallel.sequence > 1);
2. expert parallelism swaps `Experts` and shards expert weights over the expert-replica groups
   (not yet: issue 4);
3. the vocabulary-parallel loss swaps `LMHead` (not yet: issue 5);
4. activation checkpointing (and offload) wraps each block, so the recomputation includes the
   swapped modules and their collectives;
5. FSDP2 shards whatever weights remain over the world mesh (last: `fully_shard` must see the
   final module tree).

Techniques that have not landed raise NotImplementedError when their sub-group size is > 1, so
a layout can never silently run something other than what it says.
"""

from __future__ import annotations

import torch

from mop.config import Config
from mop.models.transformer import MoETransformer
from mop.parallel.checkpointing import apply_activation_checkpointing
from mop.parallel.fsdp import shard_dense
from mop.parallel.mesh import DistLayout
from mop.parallel.ulysses import apply_sequence_parallel

_PENDING = {
    "expert": "expert parallelism / LLEP (issue 4)",
    "vocab": "the vocabulary-parallel loss (issue 5)",
}


def compute_dtype(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.train.dtype == "bfloat16" else torch.float32


def apply_memory_options(model: MoETransformer, config: Config, device: torch.device) -> None:
    """The layout-independent memory options (also used by the reference strategy)."""
    if config.train.activation_checkpointing == "full":
        apply_activation_checkpointing(model, config.train.offload_activations, pin_memory=device.type == "cuda")


def parallelize(model: MoETransformer, layout: DistLayout, config: Config) -> MoETransformer:
    for name, size in (("expert", layout.layout.expert), ("vocab", layout.layout.vocab)):
        if size > 1:
            raise NotImplementedError(f"parallel.{name}={size} needs {_PENDING[name]}, which has not landed yet; "
                                      f"run with --parallel.{name}=1")
    if layout.layout.sequence > 1:
        apply_sequence_parallel(model, layout.sequence_group, config.parallel.attention_head_chunks)
    apply_memory_options(model, config, layout.device)
    shard_dense(model, layout, compute_dtype(config))
    return model
