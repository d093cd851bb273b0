"""Parallelism techniques, one file each, applied by functions to the model's seams; ``mesh``
defines the rank layout (`DistLayout`, the sub-groups) every technique is given.

A step's data path under the mop strategy (`parallelize.py` applies the techniques in order):
1. each rank holds its sequence slice (N = S/D tokens of its data group's sequences); the
   embedding and every dense weight are FSDP2 shards over the world (fsdp.py), gathered per block;
2. attention: Ulysses (ulysses.py) all-to-alls q, k, v to head-sharded whole sequences, runs the
   document attention, and returns the output to the slices; the router sums of each sequence
   are summed over its sequence group;
3. MoE: expert parallelism (llep.py) all-gathers the expert counts, plans with LLEP (llep_plan.py),
   dispatches token rows by all-to-all (llep_routing.py, or chunked: llep_chunked.py), computes
   the experts (partitions FSDP2-sharded over the expert replicas: experts.py) and combines;
4. the loss: the vocabulary ring (vocab.py) passes the output-projection shards around the
   vocabulary group, so no rank builds the full logits;
5. backward mirrors it; activation checkpointing and offload (checkpointing.py) reuse the
   forward's exchanges. FSDP2 reduce-scatters gradients; the optimizer (`mop.optim`) takes them.
views.py presents every local shard as a global tensor (checkpoints, materialisation).
"""

from mop.parallel.mesh import (
    DistLayout,
    Layout,
    LayoutError,
    TorchrunEnv,
    backend_for,
    device_for,
    init_distributed,
    set_rank_threads,
)

__all__ = [
    "DistLayout",
    "Layout",
    "LayoutError",
    "TorchrunEnv",
    "backend_for",
    "device_for",
    "init_distributed",
    "set_rank_threads",
]
