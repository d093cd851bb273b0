"""Expert weights: partitioned over the expert group, each partition FSDP2-sharded over its replicas.

Rank r holds expert partition p = r mod Ep, the experts `[p*E/Ep, (p+1)*E/Ep)` (sliced from the
full, seed-initialised weights, so initialisation stays layout-independent). The W/Ep ranks with
the same p (its expert-replica group, strided by Ep) FSDP2-shard that partition along its expert
dimension: persistent expert memory per rank is E/W experts. Before the expert layer runs, FSDP2
all-gathers the partition over the replica group; after its backward, it reduce-scatters the
partition's gradient, which by then holds the helpers' returned contributions (`llep`), summed
(not averaged: the objective is already globally normalised). With `offload` the partition's
shards live in host memory (FSDP2's CPU offload, as in `mop.parallel.fsdp`).
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from mop.parallel.fsdp import mixed_precision, offload_policy, sum_gradients
from mop.parallel.llep import BalanceOptions, ExpertParallel, apply_expert_parallel
from mop.parallel.mesh import DistLayout


def shard_experts(model, layout: DistLayout, options: BalanceOptions, compute_dtype, offload: bool = False) -> None:
    """Partition every MoE layer's experts over the expert group and shard each partition."""
    apply_expert_parallel(model, layout, options)
    for module in model.modules():
        if isinstance(module, ExpertParallel):
            # Its inputs stay as the block gives them: the routing weights fp32, as in one process (a
            # cast to the compute dtype rounded them, and torch 2.11's FSDP2 skipped it in a
            # checkpointed block's recomputation: the recomputed weights fp32, the saved bf16).
            fully_shard(module, mesh=layout.expert_replica_mesh, reshard_after_forward=True,
                        mp_policy=mixed_precision(compute_dtype, cast_inputs=False),
                        offload_policy=offload_policy(offload, layout.device))
            sum_gradients(module)
