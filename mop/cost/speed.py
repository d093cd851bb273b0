"""Predicted step time of a layout: a roofline of compute and each collective over its link.

Compute: the model FLOPs of the rank's tokens (`mop.models.spec.ModelSpec.flops_per_token`; a query attends
(L + 1) / 2 keys on average for documents of L tokens, a sliding-window layer at most its window
(`mop.flops.mean_attended_keys`), by default one document per sequence, L = S: the long-context
worst case, where attention FLOPs grow with S) plus the
recomputation the options add (full activation checkpointing: one more forward of every block;
head-chunked attention: one more forward of its core in the backward; chunked LLEP: its gate and
up GEMMs again in the backward; under checkpointing a chunked part's kept output replaces the
block's rerun of it; the ring loss: the logits again in the backward), at `cluster.mfu` x the peak.

Communication, bytes per rank per micro-batch, each over the link its group spans (NVLink when
the group is inside a node, else the network; torchrun numbers a node's ranks consecutively and
block groups are consecutive ranks, replica groups strided):
- FSDP2 (dense weights over the world, expert partitions over their W/Ep replicas): every unit
  all-gathered in the compute dtype before its forward and again before its backward, its fp32
  gradient reduce-scattered; (n-1)/n of the unit per rank;
- all-to-alls: Ulysses q/k/v/output per layer (forward, backward, and the recomputations),
  expert dispatch and combine per MoE layer (the same), tensor parallelism's per-layer
  all-gathers and reduce-scatters (baseline only);
- the vocabulary ring: the shard passes P-1 hops in forward and backward, its fp32 gradient P;
- host link: the host optimizer's gradients down and weights up, offloaded activations both ways,
  FSDP2's CPU offload of shards and gradients.
Overlap (what hides behind what): FSDP2 prefetches the next unit, so its gathers and reductions,
the ring's shard hops and the host transfers run under compute: per link the time is the
sum of its bytes / bandwidth, and the micro-batch takes max(compute, each link). All-to-alls sit
on the critical path and add to it, except chunked LLEP's, which hide behind the expert GEMMs
of the other chunks (only what exceeds them adds). The host optimizer's update runs on the
host during the last micro-batch's backward and the next forward (only the next forward without
`optim.speculative`); only what exceeds that adds. FSDP2's CPU offload steps torch AdamW on the
host after the backward: it adds in full. An update streams `UPDATE_BYTES_PER_PARAM` (60 with
the rollback copies) at `HOST_MEMORY_BYTES_PER_S`, shared by the node's ranks.

LoRA (`AdapterCounts`): a frozen weight takes no weight gradient, so every linear does two GEMMs
of three (the attention core keeps its three); FSDP2 gathers the units as stored (fp8, MXFP4) and
reduce-scatters the adapters' gradients alone; the ring sends no gradient for the frozen head; the
host link and the host optimizer carry the adapters. Not modelled: the adapters' own FLOPs
(r / hidden of the frozen GEMM's) and the dequantization (elementwise, one pass over each weight).

DPO (`data.format = "preference"`): a sequence is packed pairs, its tokens counted as any others
(the prompt once). With LoRA the reference is the base's forward in every step (adapters off, no
gradient): one more forward's FLOPs, all-to-alls and gathers. Full fine-tuning precomputes the
reference before the first step, one forward of every sequence (`StepTime.forward` per step's
sequences); its steps cost what supervised steps do. The response sums are a few numbers per pair.

Policy-gradient training on rollouts (`data.format = "rollouts"`): its steps cost what supervised
steps do (routing replay forces the selection the router computes anyway; the old log-probs of a
batch's later updates are its first step's), plus the base's forward in every step for the KL's
reference under LoRA (`rl.beta > 0`); full fine-tuning precomputes its reference once, as DPO's. Its per-token extras (the routes, 2 bytes per MoE layer and
expert pick; the old log-probs kept across a batch's updates, 4 bytes) are under a thousandth of a
token's activations and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop.config import Config
from mop.cost.activations import FP32, Shapes
from mop.cost.cluster import Cluster
from mop.cost.memory import AdapterCounts, ParameterCounts, offloaded_activations
from mop.flops import mean_attended_keys
from mop.models.families import model_spec

HOST_MEMORY_BYTES_PER_S = 400e9  # sustained memory bandwidth of a 2-socket DDR5 node (16 channels)
# Host memory an AdamW update streams per parameter: read the fp32 gradient, master and moments and
# write them back (28), accumulate the micro-batches' gradients (8); the speculative host optimizer
# also copies master and moments to their rollback spares (24).
UPDATE_BYTES_PER_PARAM = 36
SPECULATIVE_UPDATE_BYTES_PER_PARAM = UPDATE_BYTES_PER_PARAM + 24
# Chunked LLEP's backward re-runs the gate and up GEMMs, not the down one (`mop.parallel.llep_chunked`).
CHUNKED_EXPERT_RECOMPUTE = 2 / 3


@dataclass
class StepTime:
    """Seconds of one optimizer step and what they are made of (per rank)."""

    compute: float
    links: dict[str, float]  # overlapped traffic per link, per step
    exposed: dict[str, float]  # on the critical path, per step
    seconds: float
    tokens: int  # the rank's tokens per step (its share of the global batch)
    forward: float  # one forward of the step's sequences: what DPO's precomputed reference costs them, once

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "tokens_per_rank": self.tokens, "compute_s": self.compute,
                "overlapped_s": self.links, "exposed_s": self.exposed, "forward_s": self.forward}


def _link(cluster: Cluster, span: int, strided: bool = False) -> str:
    """The link a group of `span` ranks uses. Block groups (consecutive ranks) stay inside a node
    when their size divides the node's; replica groups (strided, spanning every block) only when
    the whole world is one node. A group that leaves the node is timed at the network's bandwidth
    for all of its traffic (conservative: a hierarchical collective moves part of it over NVLink)."""
    if strided:
        inside = cluster.world <= cluster.gpus_per_node
    else:
        inside = span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0
    return "nvlink" if inside else "network"


def _bandwidth(cluster: Cluster, link: str) -> float:
    return {"nvlink": cluster.nvlink_bytes_per_s, "network": cluster.network_bytes_per_s,
            "host": cluster.host_link_bytes_per_s}[link]


def _share(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_time(config: Config, cluster: Cluster, s: Shapes, counts: ParameterCounts, tp: int = 1,
              document_tokens: int = 0, adapters: AdapterCounts | None = None) -> StepTime:
    """`document_tokens`: the packed documents' length (0: one document per sequence); `adapters`:
    a LoRA run's shards (`mop.cost.memory.AdapterCounts`)."""
    m, p, t = config.model, config.parallel, config.train
    world, seq = cluster.world, config.data.seq_len
    spec = model_spec(m)
    keys = spec.layer_keys(lambda window: mean_attended_keys(min(document_tokens or seq, seq), window))
    checkpointed = t.activation_checkpointing == "full"
    # compute, per micro-batch: the model FLOPs of the rank's tokens plus the recomputation
    tokens = s.T
    model_flops = spec.flops_per_token(keys) * tokens
    forward = model_flops / 3
    if adapters is not None:  # a frozen weight takes no gradient: one GEMM of three per linear goes
        model_flops -= forward - spec.attention_core_flops(keys) * tokens
    # head-chunked attention recomputes its core (QK^T and PV) in the backward; chunked LLEP its gate
    # and up GEMMs (two thirds of the expert FLOPs). In a checkpointed block their kept outputs
    # replace the block's rerun of them.
    attention_share = spec.attention_core_flops(keys) * tokens / forward
    expert_share = spec.routed_expert_flops() * tokens / forward
    extra = forward if checkpointed else 0.0
    # DPO or the RL KL with LoRA: the base's forward (adapters off, no grad) gives the reference in every step
    extra += forward * config.reference_forward
    if p.attention_head_chunks > 1 and not checkpointed:
        extra += forward * attention_share
    if p.llep_chunks > 1:
        extra += forward * expert_share * (CHUNKED_EXPERT_RECOMPUTE - checkpointed)
    if p.vocab_logits == "recompute":  # the ring, or one rank's tiles, form each head's logits again
        extra += 2 * m.hidden * m.vocab_size * tokens * (1 + m.trained_mtp_layers)
    compute = (model_flops + extra) / (cluster.peak_flops * cluster.mfu)

    links = {"nvlink": 0.0, "network": 0.0, "host": 0.0}
    exposed = {"all_to_all": 0.0, "host_optimizer": 0.0, "cpu_adamw": 0.0}
    # FSDP2: gather twice, reduce-scatter once, per unit
    dense_world, replicas = world // tp, world // (p.expert * tp)
    if adapters is None:
        expert_units = m.moe_blocks * counts.expert_partition  # a rank's expert partitions
        dense_units = counts.total // tp - expert_units * p.expert - (m.vocab_size * m.hidden if p.vocab > 1 else 0)
        dense_traffic, expert_traffic = dense_units * (2 * s.act + FP32), expert_units * (2 * s.act + FP32)
    else:  # gathered as stored; only the adapters' gradients are reduced
        gathers = 2 + config.reference_forward
        dense_traffic = gathers * adapters.dense_gathered + adapters.dense_trained * FP32
        expert_traffic = m.moe_blocks * (gathers * adapters.partition_bytes + adapters.partition_trained * FP32)
    links[_link(cluster, dense_world, strided=tp > 1)] += _share(dense_world) * dense_traffic
    links[_link(cluster, replicas, strided=True)] += _share(replicas) * expert_traffic
    # the vocabulary ring (a frozen head sends no gradient)
    if p.vocab > 1:
        shard = -(-m.vocab_size // p.vocab) * m.hidden
        gradient = p.vocab * shard * FP32 if adapters is None else 0
        links[_link(cluster, p.vocab)] += ((p.vocab - 1) * shard * 2 * s.act + gradient) * (1 + m.trained_mtp_layers)
    # all-to-alls: passes = forward + backward (+ recomputations)
    passes = 2 + checkpointed + config.reference_forward
    ulysses = _share(p.sequence) * m.blocks * s.T * spec.attention.exchanged_width * s.act
    ulysses_passes = passes + (p.attention_head_chunks > 1 and not checkpointed)
    dispatch = _share(p.expert) * m.moe_blocks * 2 * s.A * s.H * s.act
    # chunked: rows out and back in forward, then [rows | gradients] out and [row gradients] back:
    # 2.5 passes' bytes, checkpointed or not (a checkpointed block's recomputation keeps its output)
    dispatch_passes = (2.5 + config.reference_forward) if p.llep_chunks > 1 else passes
    tensor = 4 * _share(tp) * m.blocks * s.T * tp * s.H * s.act  # TP+SP: gather/scatter around attention and MLP
    # under TP a sequence (or expert) group's members are tp ranks apart: the group spans cp x tp ranks
    a2a = ulysses * ulysses_passes / _bandwidth(cluster, _link(cluster, p.sequence * tp))
    a2a += tensor * passes / cluster.nvlink_bytes_per_s
    expert_a2a = dispatch * dispatch_passes / _bandwidth(cluster, _link(cluster, p.expert * tp))
    if p.llep_chunks > 1:  # pipelined behind the expert GEMMs of the other chunks
        expert_compute = expert_share * forward * 3 / (cluster.peak_flops * cluster.mfu)
        expert_a2a = max(0.0, expert_a2a - expert_compute * (1 - 1 / p.llep_chunks))
    exposed["all_to_all"] = a2a + expert_a2a
    # host link, per micro-batch
    local = counts.local if adapters is None else adapters.trained  # what the optimizer updates
    mbs = config.micro_batches_per_step(world)
    stored = config.storage_dtype.itemsize
    if config.optim.offload:  # every micro-batch's gradients down, the updated weights up once a step
        links["host"] += local * stored * (1 + 1 / mbs)
    if p.fsdp_cpu_offload:  # FSDP2 copies the shards up before their gathers, the gradients down
        links["host"] += local * (FP32 + FP32)
    links["host"] += 2 * offloaded_activations(config, s)  # to the host and back
    per_micro = max([compute] + [links[k] / _bandwidth(cluster, k) for k in links]) + exposed["all_to_all"]
    step = mbs * per_micro
    host_rate = HOST_MEMORY_BYTES_PER_S / cluster.gpus_per_node
    if config.optim.offload:  # hidden behind the last micro-batch's backward and the next forward,
        # or (not speculating) behind the next forward only
        hidden = per_micro if config.optim.speculative else forward / (cluster.peak_flops * cluster.mfu)
        update = SPECULATIVE_UPDATE_BYTES_PER_PARAM if config.optim.speculative else UPDATE_BYTES_PER_PARAM
        exposed["host_optimizer"] = max(0.0, local * update / host_rate - hidden)
    if p.fsdp_cpu_offload:
        exposed["cpu_adamw"] = local * UPDATE_BYTES_PER_PARAM / host_rate
    seconds = step + exposed["host_optimizer"] + exposed["cpu_adamw"]
    overlapped = {k: mbs * links[k] / _bandwidth(cluster, k) for k in links}
    return StepTime(mbs * compute, overlapped, {k: v * (mbs if k == "all_to_all" else 1) for k, v in exposed.items()},
                    seconds, mbs * s.T, mbs * forward / (cluster.peak_flops * cluster.mfu))
