"""FSDP2 for the dense weights: one `fully_shard` unit per block, plus the root (embedding, final norm, head).

Algorithm: every parameter of a unit is sharded along dim 0 over the W ranks of the world mesh;
before the unit runs, FSDP2 all-gathers it (forward and again in backward, since parameters are
resharded after forward), and after the backward it reduce-scatters the gradient.

Invariant: the trainer's per-rank objective is already normalised by the global token count
(`MoETransformer.objective`), so the global gradient is the SUM of the per-rank gradients, not
their mean: every unit's gradient divide factor is set to 1.

Expert weights under expert parallelism are sharded by `mop.parallel.experts` (its own units,
on the expert-replica mesh), which `fully_shard` here then leaves alone; the vocabulary shard of
`mop.parallel.vocab` is passed as ignored. Without vocabulary parallelism the output weight is
sharded over the world like the dense ones.

Offload (the fsdp2 baseline's `parallel.fsdp_cpu_offload`): FSDP2's `CPUOffloadPolicy` keeps each
unit's parameter and gradient shards in host memory, copies the shard to the device before the
all-gather and the reduced gradient shard back after the reduce-scatter; the optimizer then steps
on the host shards. Pinned memory needs an accelerator, so the shards are pinned on CUDA only.
"""

from __future__ import annotations

import typing

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from mop.models.moe import RouterStats
from mop.models.transformer import MoETransformer
from mop.parallel.mesh import DistLayout

# FSDP2 gathers a unit's weights again for its backward from hooks on the tensors the unit returns.
# torch 2.11's FSDP2 finds them with pytree, which does not look inside a dataclass unless it is
# registered (2.13's looks inside dataclasses itself): without this, what the root's entry points return
# (`MoETransformer.FORWARD_METHODS`: `LossTerms`, `PreferenceTerms`, `PolicyTerms`) and a block's `RouterStats`
# carry no hook, and their backward reads weights already freed (a crash in native code).
for _output in {typing.get_type_hints(getattr(MoETransformer, method))["return"]
                for method in MoETransformer.FORWARD_METHODS} | {RouterStats}:
    torch.export.register_dataclass(_output)


def mixed_precision(compute_dtype: torch.dtype | None, cast_inputs: bool = True) -> MixedPrecisionPolicy:
    """Parameters gathered in the compute dtype (None: each in its own, `gather_dtype`); gradients
    always reduced in fp32; with `cast_inputs` the unit's floating-point inputs cast to the compute dtype."""
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs)


def offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's CPU offload when asked for (see the module docstring), else none."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()


def shard_dense(model: MoETransformer, layout: DistLayout, compute_dtype: torch.dtype | None = torch.float32,
                ignored: set[torch.nn.Parameter] = frozenset(), offload: bool = False) -> None:
    """FSDP2 units for every block and the root; `ignored` parameters (the vocabulary shard) stay as they are."""
    options = {"mesh": layout.world_mesh, "reshard_after_forward": True, "mp_policy": mixed_precision(compute_dtype),
               "offload_policy": offload_policy(offload, layout.device)}
    for block in model.layers:
        fully_shard(block, **options)
    # The root's only floating-point inputs are DPO's float64 reference sums (`preference_terms`), which a
    # cast to the compute dtype would round (to fp32: the first step's rewards not 0; to bf16: by about 0.2
    # nats on the debug model).
    fully_shard(model, ignored_params=set(ignored) or None, **{**options, "mp_policy": mixed_precision(
        compute_dtype, cast_inputs=False)})
    # The objectives call the model's terms methods, not forward; FSDP2 gathers the root's weights for them too.
    for method in MoETransformer.FORWARD_METHODS:
        register_fsdp_forward_method(model, method)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            sum_gradients(module)


def sum_gradients(module: FSDPModule) -> None:
    """Reduce this unit's gradients by a plain sum over its mesh (see the module docstring)."""
    module.set_gradient_divide_factor(1.0)
    # A plain SUM: the pre-multiplied sum FSDP2 would otherwise pick is NCCL-only.
    module.set_force_sum_reduction_for_comms(True)
