"""Model shape: the architecture hyper-parameters of a decoder-only MoE transformer, shared by every
family, and the family by name.

`ModelShape` is what the families and the shared layers read: `family` names the model family
(`mop.models.families`), whose spec turns these fields into parameter counts, FLOPs and activation
bytes (`mop.models.spec`), and `options` holds its own hyper-parameters, its `Options` dataclass
(built by the registry, `mop.models.config.ModelConfig`, the `[model]` section of a training
config). Presets for real models live in `configs/*.toml`; the defaults here are the tiny CPU debug
model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}  # the field types, as annotations spell them


@dataclass(frozen=True)
class ModelShape:
    family: str = "qwen3_moe"
    """The model family (`mop.models.families`): its attention, its spec and its HF `model_type`."""
    vocab_size: int = 259
    """Rows of the embedding and of the output projection (must cover the tokenizer's ids)."""
    hidden: int = 128
    """Model width H."""
    layers: int = 4
    """Number of transformer blocks L."""
    heads: int = 4
    """Query heads per attention layer."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide `heads`."""
    head_dim: int = 32
    """Width of one attention head (need not equal hidden / heads, as in Qwen3)."""
    qk_norm: bool = True
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3); false for Mixtral."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    experts: int = 8
    """Routed experts per MoE layer E."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_intermediate: int = 128
    """Intermediate width I of one routed SwiGLU expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one (Qwen3 option; Mixtral always does)."""
    shared_expert_intermediate: int = 0
    """Intermediate width of an always-on shared SwiGLU expert (DeepSeek style); 0 means none."""
    dense_layers: int = 0
    """The first `dense_layers` blocks use a dense SwiGLU MLP instead of an MoE layer."""
    dense_intermediate: int = 256
    """Intermediate width of the dense MLP of the first `dense_layers` blocks."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the language-model loss (0 disables it)."""
    z_loss_coef: float = 0.0
    """Weight of the z-loss, the mean over targets of log(sum(exp(logits)))^2 (0 disables it)."""
    mtp_layers: int = 0
    """Multi-token-prediction modules after the last block, DeepSeek-V3's MTP of depth D
    (`num_nextn_predict_layers` of an imported DeepSeek-V3 or GLM-4.5): built and trained only with
    `mtp_loss_coef` > 0 (`mop.models.mtp`); otherwise an import's stay frozen outside the model and
    `mop convert to-hf` passes them through."""
    mtp_loss_coef: float = 0.0
    """lambda of DeepSeek-V3's MTP objective: the step loss adds lambda / D x the sum over depths of
    each depth's mean cross-entropy over its targets (0: the MTP modules are not built)."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    options: object = None
    """The family's own hyper-parameters (`[model.options]`; its `Family.options`, listed per family
    below); None for a family that has none."""

    def validate(self) -> list[tuple[str, str]]:
        """Problems of the shared fields as (key, message) pairs; empty when the shape is buildable."""
        problems = wrong_types(self)
        if problems:
            return problems
        for key in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "top_k"):
            if getattr(self, key) < 1:
                problems.append((key, f"must be >= 1, got {getattr(self, key)}"))
        if problems:
            return problems
        if self.heads % self.kv_heads:
            problems.append(("kv_heads", f"{self.kv_heads} must divide model.heads={self.heads}"))
        if self.head_dim % 2:
            problems.append(("head_dim", f"{self.head_dim} must be even for RoPE"))
        if self.top_k > self.experts:
            problems.append(("top_k", f"{self.top_k} exceeds model.experts={self.experts}"))
        if not 0 <= self.dense_layers <= self.layers:
            problems.append(("dense_layers", f"must be in [0, model.layers={self.layers}]"))
        if self.expert_intermediate < 1:
            problems.append(("expert_intermediate", "must be >= 1"))
        if self.dense_layers and self.dense_intermediate < 1:
            problems.append(("dense_intermediate", "must be >= 1 when model.dense_layers > 0"))
        if self.shared_expert_intermediate < 0:
            problems.append(("shared_expert_intermediate", "must be >= 0 (0 disables the shared expert)"))
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                problems.append((key, f"must be >= 0 (0 disables it), got {getattr(self, key)}"))
        if self.mtp_layers < 0 or self.mtp_loss_coef < 0:
            key = "mtp_layers" if self.mtp_layers < 0 else "mtp_loss_coef"
            problems.append((key, f"must be >= 0, got {getattr(self, key)}"))
        elif self.mtp_loss_coef and not self.mtp_layers:
            problems.append(("mtp_loss_coef", "trains the multi-token-prediction modules, but model.mtp_layers is 0; "
                             "set their depth (1 for DeepSeek-V3 and GLM-4.5)"))
        for key in ("init_std", "norm_eps", "rope_theta"):
            if getattr(self, key) <= 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        return problems

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def blocks(self) -> int:
        """The decoder blocks the model runs: its layers and its trained MTP depths' blocks."""
        return self.layers + self.trained_mtp_layers

    @property
    def moe_blocks(self) -> int:
        """The MoE blocks the model runs (an MTP depth's block is one)."""
        return self.moe_layers + self.trained_mtp_layers

    @property
    def trained_mtp_layers(self) -> int:
        """The multi-token-prediction modules the model builds and trains (`mtp_layers` when
        `mtp_loss_coef` > 0, else none)."""
        return self.mtp_layers if self.mtp_loss_coef else 0

def wrong_types(config) -> list[tuple[str, str]]:
    """Values of a config dataclass that are not of their field's type (a float field takes an int
    too; a bool is no int): possible from a hand-written config.json, whose values no TOML type check
    has seen. Fields of another type than int, float, bool and str are checked by their owner."""
    problems = []
    for f in fields(config):
        value, kind = getattr(config, f.name), f.type if isinstance(f.type, str) else f.type.__name__
        if kind in _TYPES and (isinstance(value, bool) != (kind == "bool") or not isinstance(value, _TYPES[kind])):
            problems.append((f.name, f"expects {kind}, got {type(value).__name__} {value!r}"))
    return problems
