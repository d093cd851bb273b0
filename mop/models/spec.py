"""A model's shape facts: the one owner of its parameter counts, its FLOPs and its activation bytes.

Every family (`mop.models.families`) builds a `ModelSpec` from its config: the family's attention
supplies an `AttentionSpec` (head widths, parameters, what it saves for its backward), the shared
MoE and MLP layers supply the rest. `mop.flops` (MFU), `mop plan` (memory and step time), `mop
bench gpu` and the run builder ask the spec and hold no formula of their own; a test checks the
parameter counts against the model built on the meta device.

Conventions:
- parameters by category: `expert` (the routed experts' stacked weights), `vocabulary` (the
  embedding and the output projection, one table when tied) and `dense` (everything else:
  attention, norms, routers, dense MLPs, shared experts).
- FLOPs per trained token (forward + backward = 3 x forward, multiply-add = 2 FLOPs): 6 x the
  parameters one token is multiplied with (the embedding lookup is no matmul), plus the attention
  core, 2 matmuls per query head of (q/k width, v width) x the keys the query attends, 2 FLOPs x 3.
  Causal attention counts the keys a query really attends (`mop.flops.attended_keys`: its position
  in its document + 1, at most the window in a sliding-window layer), not the full sequence some
  reports count. Recomputation (activation
  checkpointing, chunked LLEP, the vocabulary ring) is no model FLOP.
- activation bytes are per token of one layer, for an activation element of `act` bytes; what
  the code keeps in fp32 (RMSNorm internals, softmax statistics) counts 4 bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from mop.models.shape import ModelShape

FP32 = 4


def norm_saved_bytes(width: int, act: int) -> int:
    """What one RMSNorm over `width` adds per normalised row (`mop.models.layers.RMSNorm` saves its
    input and the fp32 inverse rms): the inverse rms, and a row of `width` activations, its output
    where the next matmul saves that (a block's norms, whose input the caller counts as the residual
    stream) or its input where nothing else keeps it (q/k norms, whose output RoPE does not save)."""
    return width * act + FP32


def core_saved_bytes(attention: "AttentionSpec", act: int, head_chunks: int) -> int:
    """What the local q, k, v and the sequence-mixing core keep per token, for any attention that
    hands per-head q, k, v to the shared core; `head_chunks` as `AttentionSpec.saved_bytes_per_token`."""
    local_qkv = (attention.q_width + attention.k_width + attention.v_width) * act
    if head_chunks > 1:  # `_HeadChunkedAttention` saves the local q, k, v; its output feeds o_proj
        return local_qkv + attention.out_width * act
    # the head-sharded output (under D = 1 the kernel's own output), the softmax statistics,
    # and o_proj's input (the output back in the sequence-sharded layout)
    return local_qkv + 2 * attention.out_width * act + attention.heads * FP32


@dataclass(frozen=True)
class AttentionSpec(ABC):
    """One attention layer's shape facts, owned by the family's attention module."""

    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (as the core receives them)."""
    qk_head_dim: int
    """Width of one query or key head, the dot product's width."""
    v_head_dim: int
    """Width of one value head, and of one head of the core's output."""

    @property
    def q_width(self) -> int:
        return self.heads * self.qk_head_dim

    @property
    def k_width(self) -> int:
        return self.kv_heads * self.qk_head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.v_head_dim

    @property
    def out_width(self) -> int:
        return self.heads * self.v_head_dim

    @property
    def exchanged_width(self) -> int:
        """Elements per token that sequence parallelism moves per layer and pass: q, k and v to the
        head-sharded layout, the output back."""
        return self.q_width + self.k_width + self.v_width + self.out_width

    @property
    @abstractmethod
    def parameters(self) -> int:
        """Parameters of one layer (projections and norms)."""

    @property
    @abstractmethod
    def matmul_parameters(self) -> int:
        """Parameters one token is multiplied with in one layer's forward."""

    def core_flops_per_key(self) -> int:
        """Forward FLOPs of one query against one key: q.k and p.v for every query head."""
        return 2 * self.heads * (self.qk_head_dim + self.v_head_dim)

    @abstractmethod
    def saved_bytes_per_token(self, act: int, head_chunks: int) -> int:
        """What one layer keeps for its backward, per token; `head_chunks` > 1: the head-chunked core
        (`mop.parallel.ulysses`), which recomputes its kernel in the backward."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one `ModelShape`: parameter counts, FLOPs, activation widths and bytes."""

    cfg: ModelShape
    attention: AttentionSpec

    # ---------------------------------------------------------------- parameters

    def mlp_parameters(self, intermediate: int) -> int:
        """A SwiGLU MLP of this width (dense block, shared expert, one routed expert)."""
        return 3 * self.cfg.hidden * intermediate

    def expert_parameters(self) -> int:
        """One routed expert's parameters: a SwiGLU of `expert_intermediate` (a family whose experts
        have biases adds them)."""
        return self.mlp_parameters(self.cfg.expert_intermediate)

    def router_parameters(self) -> int:
        """One MoE layer's router: a linear map to the experts (a family whose router has a bias adds it)."""
        return self.cfg.experts * self.cfg.hidden

    def moe_dense_parameters(self) -> int:
        """One MoE layer's non-expert parameters: the router and the shared expert."""
        return self.router_parameters() + self.mlp_parameters(self.cfg.shared_expert_intermediate)

    def parameters(self) -> dict[str, int]:
        """Parameter elements by category (`dense`, `expert`, `vocabulary`; the module docstring); a
        trained MTP depth (`mop.models.mtp`) counts as one more MoE block plus its own norms and `eh_proj`."""
        m, depth = self.cfg, self.cfg.trained_mtp_layers
        norms = 2 * m.hidden
        mtp = depth * (3 * m.hidden + 2 * m.hidden * m.hidden)  # each depth's norms and eh_proj
        mlps = m.dense_layers * self.mlp_parameters(m.dense_intermediate) + m.moe_blocks * self.moe_dense_parameters()
        dense = m.blocks * (self.attention.parameters + norms) + mlps + m.hidden + mtp
        expert = m.moe_blocks * m.experts * self.expert_parameters()
        vocabulary = m.vocab_size * m.hidden * (1 if m.tie_embeddings else 2)
        return {"dense": dense, "expert": expert, "vocabulary": vocabulary}

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters().values())

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        m = self.cfg
        unused = m.moe_blocks * (m.experts - m.top_k) * self.expert_parameters()
        return self.total_parameters - unused

    # ---------------------------------------------------------------- FLOPs

    def matmul_parameters_per_token(self) -> int:
        """Parameters each token is multiplied with once in a forward (a trained MTP depth: its block,
        `eh_proj` and the output projection once more)."""
        m, depth = self.cfg, self.cfg.trained_mtp_layers
        # matrices only: the router's and the experts' (a family's biases are no matmul)
        moe = m.experts * m.hidden + self.mlp_parameters(m.shared_expert_intermediate) + m.top_k * self.mlp_parameters(
            m.expert_intermediate)
        dense = m.dense_layers * self.mlp_parameters(m.dense_intermediate)
        layers = m.blocks * self.attention.matmul_parameters + dense + m.moe_blocks * moe
        return layers + (1 + depth) * m.hidden * m.vocab_size + depth * 2 * m.hidden * m.hidden

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (the keys a query sees, itself included; None: its whole
        document so far). A family with sliding-window layers says which."""
        return [None] * self.cfg.blocks  # the MTP depths' blocks last

    def layer_keys(self, keys_of) -> float:
        """The keys a token attends, summed over the layers: `keys_of(window)` is what one layer of
        that window (None: full causal) attends (`mop.flops.attended_keys`), asked once per window."""
        windows = self.layer_windows()
        by_window = {window: keys_of(window) for window in set(windows)}
        return sum(by_window[window] for window in windows)

    def attention_core_flops(self, layer_keys: float) -> float:
        """Forward FLOPs of the attention cores for one token attending `layer_keys` keys summed over
        the layers (`layer_keys`)."""
        return self.attention.core_flops_per_key() * layer_keys

    def routed_expert_flops(self) -> float:
        """Forward FLOPs of one token's routed experts over every MoE layer."""
        m = self.cfg
        return 2 * m.moe_blocks * m.top_k * self.mlp_parameters(m.expert_intermediate)

    def flops_per_token(self, layer_keys: float) -> float:
        """Model FLOPs of training one token that attends `layer_keys` keys summed over the layers
        (on average; `layer_keys`)."""
        return 3 * (2 * self.matmul_parameters_per_token() + self.attention_core_flops(layer_keys))
