"""The FSDP2 baseline (`parallel.strategy = "fsdp2"`): what a TorchTitan user would run, from torch's pieces.

Algorithm, in `parallelize`'s order without mop's own techniques:
1. context parallelism (parallel.sequence = D > 1): the D ranks of a sequence group hold
   consecutive slices of the same sequences (the trainer's `sequence_shard`, as under mop) and
   attention runs mop's Ulysses core (`mop.parallel.ulysses`) with one head chunk. Torch's own
   `torch.distributed.tensor.experimental.context_parallel` (torch 2.13) was tried first and
   cannot run this model here: on CPU, SDPA dispatches to
   `aten._scaled_dot_product_flash_attention_for_cpu`, for which it has neither a ring-attention
   handler nor a DTensor sharding rule (only the CUDA flash / efficient / cuDNN kernels have
   them); and it shards every tensor argument of SDPA along the sequence, so the packed-document
   `attn_mask` is rejected (its ring kernels take `is_causal` only);
2. standard expert parallelism (parallel.expert = Ep > 1): `shard_experts` with the plain "ep"
   balance, every expert computed on its owner; each partition FSDP2-sharded over its replicas;
3. activation checkpointing (and offload of the saved block inputs) per block, exactly as the
   reference applies it (`apply_memory_options`);
4. FSDP2 over the world mesh for every remaining weight, the output projection included: one
   unit per block plus the root (`shard_dense`). The loss is the model's full-logits
   cross-entropy (parallel.vocab = 1).

Communication per step: every unit all-gathers its parameters before its forward and again
before its backward (resharded after forward) and reduce-scatters its fp32 gradients after the
backward; with Ep > 1 each MoE layer moves its tokens by one all-to-all there and one back
within the expert group; with D > 1 each layer's attention does the same within the sequence
group (plus an all-gather of the document ids); the trainer all-reduces the squared gradient norm.

Offload (parallel.fsdp_cpu_offload): FSDP2's `CPUOffloadPolicy` on every unit, dense and expert,
so parameter and gradient shards live in host memory and `torch.optim.AdamW` steps there after
the backward. On a CPU-only machine host and device are the same memory: the policy runs
(unpinned) and is exact.

Invariants: every layout gives the reference's losses (gradients reduced by a plain SUM, since
the objective is already globally normalised; see `mop.parallel.fsdp`). The mop-only settings
(LLEP, chunked EP, head-chunked attention, the vocabulary-parallel loss, the host optimizer) are
config errors under this strategy (`mop.config`), never silently ignored.
"""

from __future__ import annotations

from mop.config import Config, ConfigError, lookup
from mop.models.transformer import MoETransformer
from mop.parallel.experts import shard_experts
from mop.parallel.fsdp import shard_dense
from mop.parallel.llep import BalanceOptions
from mop.parallel.mesh import DistLayout
from mop.parallel.parallelize import apply_memory_options, gather_dtype
from mop.parallel.ulysses import apply_sequence_parallel


def parallelize_fsdp2(model: MoETransformer, layout: DistLayout, config: Config) -> MoETransformer:
    dtype, offload = gather_dtype(config), config.parallel.fsdp_cpu_offload
    if layout.layout.sequence > 1:
        apply_sequence_parallel(model, layout.sequence_group, head_chunks=1)
    if layout.layout.expert > 1:
        shard_experts(model, layout, BalanceOptions(mode="ep"), dtype, offload=offload)
    apply_memory_options(model, config, layout.device)
    shard_dense(model, layout, dtype, offload=offload)
    return model


# Settings that switch on one of mop's own techniques, with their off value and why the fsdp2
# baseline (torch's pieces only) refuses them instead of silently ignoring them.
_MOP_ONLY = {
    "parallel.vocab": (1, "the fsdp2 baseline computes the full logits"),
    "parallel.expert_balance": ("ep", "LLEP is mop's; the fsdp2 baseline runs standard expert parallelism"),
    "parallel.llep_chunks": (1, "chunked expert parallelism is mop's; the fsdp2 baseline runs standard EP"),
    "parallel.attention_head_chunks": (1, "head-chunked attention is mop's; the fsdp2 baseline runs plain Ulysses"),
    "optim.offload": (False, "the host optimizer is mop's (the fsdp2 baseline offloads with "
                             "--parallel.fsdp_cpu_offload=true)"),
}


def check_settings(config: Config, world: int) -> None:
    """Each strategy's own settings only where they apply (see `_MOP_ONLY`)."""
    if config.parallel.strategy != "fsdp2":
        if config.parallel.fsdp_cpu_offload:
            raise ConfigError("parallel.fsdp_cpu_offload", "is the fsdp2 baseline's offload; set "
                              "--parallel.strategy=fsdp2 (mop offloads with --optim.offload=true)")
        return
    for key, (off, reason) in _MOP_ONLY.items():
        if lookup(config, key) != off:
            raise ConfigError(key, f"{reason}; set --{key}={str(off).lower()} or use --parallel.strategy=mop")
