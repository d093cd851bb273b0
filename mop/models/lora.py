"""LoRA fine-tuning: low-rank adapters over a frozen base kept in the precision it was published in.

`add_adapters(model, lora)` turns a built `MoETransformer` (usually on the meta device, before it
is parallelised) into its LoRA form, in place:
- every parameter of the base is frozen (`requires_grad=False`): no gradient, optimizer state or
  host master exists for it;
- each targeted linear layer becomes an `AdaptedLinear`, `y = base(x) + scaling B A dropout(x)`
  with `A [r, in]`, `B [out, r]`, `scaling = alpha / r` (PEFT's `lora.Linear`);
- the routed experts become `AdaptedExperts`: one A/B pair per expert and projection, stacked
  like the experts (`<projection>_lora_A [E, r, in]`, `<projection>_lora_B [E, out, r]`), so expert
  parallelism partitions, ships and returns them with their expert (they are part of the experts'
  `ExpertKind`); PEFT's `target_parameters` on fused expert tensors holds the same values;
- with a quantized `base_format` the frozen projection weights are kept as their format stores them
  (`mop.models.formats`: fp8 e4m3 with block scales, MXFP4 experts) and dequantized for each GEMM,
  forward and backward (`mop.models.projections`, `_FrozenLinear`): a FSDP2 unit gathers the stored
  bytes and only one layer's projection is ever widened at a time.
A is initialised as PEFT does, uniform in +-1/sqrt(in) (kaiming-uniform with a = sqrt(5)), B at zero,
so step 0 computes the base model (`mop.models.transformer.initial_rows`).

Targets (`LoraConfig.targets`, comma-separated): the kinds `attention` (every projection of the
family's attention, latent attention's down and up projections included), `dense_mlp` (the dense
blocks' SwiGLU), `shared_experts`, `routed_experts`, or the leaf names of modules (`q_proj`,
`kv_b_proj`, `experts`, ...). The routers, the embedding, the output projection and the norms stay
frozen without adapters.

Dropout (linear layers only: as in PEFT, routed experts' adapters take none) draws each rank's own
masks, so a run with dropout is the same in distribution, not element for element, on every layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mop.models.formats import StoredFormat, format_named
from mop.models.layers import SwiGLU, compute_dtype_of
from mop.models.moe import ExpertKind, MoE
from mop.models.projections import Adapted, Dense, Dequantized

KINDS = ("attention", "dense_mlp", "shared_experts", "routed_experts")
NOT_ADAPTABLE = ("router", "embedding", "embeddings", "lm_head")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    """Rank r of every adapter."""
    alpha: float = 32.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on a linear adapter's input (routed experts take none, as in PEFT); each rank draws its
    own masks, so a run with dropout is equal in distribution, not element for element, across layouts."""
    targets: str = ",".join(KINDS)
    """Comma-separated modules that get adapters: the kinds attention, dense_mlp, shared_experts,
    routed_experts, or module names (q_proj, kv_b_proj, experts, ...)."""
    base_format: str = "auto"
    """How the frozen base is kept on the devices. "auto": as the base was published (fp8 e4m3 with its
    block scales, MXFP4 experts; unquantized: the compute dtype); "none": in the compute dtype (a
    quantized base is dequantized as it is read); "fp8" (or "fp8:RxC" for blocks of R rows and C
    columns; default 128x128): the projections stored as fp8 e4m3 with block scales, as DeepSeek-V3
    publishes them (a base published unquantized is quantized as it is read); "mxfp4": the routed
    experts in MXFP4, as gpt-oss publishes them."""
    base: str = ""
    """The Hugging Face model directory whose weights are the frozen base, read in place shard by
    shard (its config.json gives the model unless [model] is set to the same); empty: the run's
    own initial weights (a random base, for trying things out)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def target_list(self) -> list[str]:
        return [item.strip() for item in self.targets.split(",") if item.strip()]

    def format(self) -> StoredFormat | None:
        """The resolved `base_format` as a `mop.models.formats` format (None: the compute dtype)."""
        return parse_format(self.base_format)

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.rank < 1:
            problems.append(("rank", f"must be >= 1, got {self.rank}"))
        if not 0 <= self.dropout < 1:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        if not self.target_list():
            problems.append(("targets", "names no module; e.g. attention,routed_experts"))
        for item in self.target_list():
            if item in NOT_ADAPTABLE:
                problems.append(("targets", f"{item} adapters are not implemented; mop adapts {', '.join(KINDS)}"))
        try:
            parse_format(self.base_format)
        except ValueError as err:
            problems.append(("base_format", str(err)))
        return problems


def parse_format(text: str) -> StoredFormat | None:
    """A `base_format` value as a format object (None: the compute dtype); "auto" is decided by the run."""
    if text in ("none", "auto"):
        return None
    fmt = format_named(text)
    if fmt is None:
        raise ValueError(f"{text!r} is not a base format; use auto, none, fp8, fp8:RxC (e.g. fp8:128x128) or mxfp4")
    return fmt


def format_name(fmt: StoredFormat | None) -> str:
    """The `base_format` value of a format object (`parse_format`'s inverse)."""
    return "none" if fmt is None else fmt.name


class _FrozenLinear(torch.autograd.Function):
    """`x W^T` for a weight stored in a format: dequantized in the forward and again in the backward,
    keeping only the stored tensors (the FSDP2 unit's gathered parameters)."""

    @staticmethod
    def forward(ctx, x, fmt, stored: tuple[torch.Tensor, ...]):
        dtype = compute_dtype_of(x)
        ctx.fmt, ctx.stored, ctx.dtype, ctx.input_dtype = fmt, stored, dtype, x.dtype
        return F.linear(x.to(dtype), fmt.dequantize(*stored, dtype))

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.fmt.dequantize(*ctx.stored, ctx.dtype)
        return (grad.to(ctx.dtype) @ weight).to(ctx.input_dtype), None, None


class AdapterSwitch:
    """Whether a model's adapters take part in its forward: one object per model, shared by every
    adapted module and experts kind (and the copies parallelism makes of a kind), so turning it off
    runs the frozen base in the same layout with the same collectives (`adapters_disabled`)."""

    enabled: bool = True


@contextmanager
def adapters_disabled(model: nn.Module):
    """Run `model`'s frozen base inside the block: DPO's reference with LoRA (`mop.objectives.preference`)."""
    switch = model.adapter_switch
    switch.enabled = False
    try:
        yield
    finally:
        switch.enabled = True


class AdaptedLinear(nn.Module):
    """`nn.Linear`'s function over a frozen weight (in the compute dtype, or stored in `fmt`), plus
    LoRA adapters when `rank` (module docstring). Parameters: `weight` (and its format's companions,
    `weight_scale_inv`), `bias`, `lora_A`, `lora_B`."""

    def __init__(self, linear: nn.Linear, rank: int, lora: LoraConfig, fmt: StoredFormat | None, switch: AdapterSwitch):
        super().__init__()
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.switch = switch
        self.stored_parameters = _register_stored(self, "weight", (self.out_features, self.in_features), fmt)
        self.bias = None if linear.bias is None else nn.Parameter(torch.empty(self.out_features), requires_grad=False)
        self.rank, self.scaling = rank, lora.scaling
        if rank:
            self.lora_A = nn.Parameter(torch.empty(rank, self.in_features))
            self.lora_B = nn.Parameter(torch.empty(self.out_features, rank))
            self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            stored = tuple(getattr(self, name) for name in self.stored_parameters)
            y = _FrozenLinear.apply(x, self.fmt, stored)
            y = y if self.bias is None else y + self.bias
        if self.rank and self.switch.enabled:
            y = y + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling
        return y

    def frozen_weights(self, path: str) -> list[FrozenWeight]:
        """Its weight, named as the module at `path` holds it."""
        adapters = (f"{path}.lora_A", f"{path}.lora_B") if self.rank else None
        return [FrozenWeight(f"{path}.weight", (self.out_features, self.in_features), self.fmt,
                             tuple(f"{path}.{name}" for name in self.stored_parameters), False, adapters)]


def _register_stored(module: nn.Module, name: str, shape: tuple[int, ...], fmt: StoredFormat | None,
                     transposed: bool = False) -> tuple[str, ...]:
    """Register the frozen weight `name`, of `shape` in the model (`[E, in, out]` when `transposed`),
    as `fmt` stores it; returns the stored names."""
    if fmt is None:
        module.register_parameter(name, nn.Parameter(torch.empty(shape), requires_grad=False))
        return (name,)
    names = tuple(name + suffix for suffix in fmt.suffixes)
    stored_shapes = fmt.stored_shapes(fmt.reoriented(shape, transposed))
    for stored_name, stored_shape, dtype in zip(names, stored_shapes, fmt.stored_dtypes()):
        module.register_parameter(stored_name, nn.Parameter(torch.empty(stored_shape, dtype=dtype),
                                                            requires_grad=False))
    return names


@dataclass(frozen=True)
class AdaptedKind(ExpertKind):
    """An experts kind whose projections are frozen (stored in `formats`) and, with `rank`, adapted:
    its names are the base kind's, each projection replaced by its stored tensors, then the
    adapters'."""

    base_names: tuple[str, ...] = ()
    stored: tuple[tuple[str, ...], ...] = ()  # per projection: its stored tensors' names
    formats: tuple[StoredFormat | None, ...] = ()  # per projection: its format (None: the compute dtype)
    rank: int = 0
    scaling: float = 1.0
    switch: AdapterSwitch = field(default_factory=AdapterSwitch, compare=False)

    def tensors(self, stacked: tuple[torch.Tensor, ...]) -> dict:
        tensors = dict(zip(self.names, stacked))
        out = {name: tensors[name] for name in self.base_names if name in tensors}
        for projection, names, fmt in zip(self.projections, self.stored, self.formats):
            stored = tuple(tensors[name] for name in names)
            base = Dense(stored[0], projection.transposed) if fmt is None else _dequantized(projection, fmt, stored)
            if self.rank and self.switch.enabled:
                base = Adapted(base, tensors[f"{projection.name}_lora_A"], tensors[f"{projection.name}_lora_B"],
                               self.scaling)
            out[projection.name] = base
        return out


def _dequantized(projection, fmt: StoredFormat, stored: tuple[torch.Tensor, ...]) -> Dequantized:
    """A stacked projection stored in `fmt` as the tensors `stored`: what `fmt` dequantizes is
    `[E, in, out]` when the model holds the projection so or the format stores every weight so."""
    out_features, in_features = _out_in(fmt.weight_shape(stored[0].shape, projection.transposed), projection.transposed)
    return Dequantized(fmt, stored, projection.transposed or fmt.input_major, in_features, out_features)


class AdaptedExperts(nn.Module):
    """A family's routed experts with their projections frozen (stored in `fmt`) and, when `rank`,
    one adapter pair per expert and projection (module docstring); biases stay frozen as they are."""

    def __init__(self, experts: nn.Module, rank: int, lora: LoraConfig, fmt: StoredFormat | None,
                 switch: AdapterSwitch):
        super().__init__()
        kind, self.num_experts = experts.kind, experts.num_experts
        projections = {p.name: p for p in kind.projections}
        names, stored, formats, self.stored_parameters = [], [], [], ()
        for name, tensor in zip(kind.names, kind.stacked(experts)):
            if name not in projections:
                self.register_parameter(name, nn.Parameter(torch.empty_like(tensor), requires_grad=False))
                names.append(name)
                continue
            projection = projections[name]
            own = None if fmt is None else fmt.for_experts(projection.parts)
            kept = _register_stored(self, name, tuple(tensor.shape), own, projection.transposed)
            self.stored_parameters += kept if own is not None else ()
            names += kept
            stored.append(kept)
            formats.append(own)
        if rank:
            for projection in kind.projections:
                out, inp = _out_in(getattr(experts, projection.name).shape, projection.transposed)
                experts_count = self.num_experts
                a, b = f"{projection.name}_lora_A", f"{projection.name}_lora_B"
                self.register_parameter(a, nn.Parameter(torch.empty(experts_count, rank, inp)))
                self.register_parameter(b, nn.Parameter(torch.empty(experts_count, out, rank)))
                names += [f"{projection.name}_lora_A", f"{projection.name}_lora_B"]
        self.kind = AdaptedKind(tuple(names), kind.run, kind.projections, kind.options, kind.names, tuple(stored),
                                tuple(formats), rank, lora.scaling, switch)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, **run_options) -> torch.Tensor:
        return self.kind.forward(self, x, expert_ids, weights, **run_options)

    def frozen_weights(self, path: str) -> list[FrozenWeight]:
        """Its projections' weights, named as the module at `path` holds them, in the kind's order."""
        kind, out = self.kind, []
        for projection, names, fmt in zip(kind.projections, kind.stored, kind.formats):
            data, name = getattr(self, names[0]).shape, f"{path}.{projection.name}"
            shape = tuple(data) if fmt is None else fmt.weight_shape(data, projection.transposed)
            adapters = (f"{name}_lora_A", f"{name}_lora_B") if kind.rank else None
            out.append(FrozenWeight(name, shape, fmt, tuple(f"{path}.{n}" for n in names), projection.transposed,
                                    adapters))
        return out


def _out_in(shape, transposed: bool) -> tuple[int, int]:
    """(out, in) features of a stacked projection of `shape`."""
    return (shape[2], shape[1]) if transposed else (shape[1], shape[2])


def _linear_kind(block: nn.Module, path: str) -> str | None:
    """The target kind of the linear layer at `path` inside a block (None: not adaptable)."""
    if path.startswith("attention."):
        return "attention"
    if path.startswith("mlp.shared."):
        return "shared_experts"
    if isinstance(block.mlp, SwiGLU) and path.startswith("mlp."):
        return "dense_mlp"
    return None


def adaptable_modules(model: nn.Module) -> list[tuple[str, str, str]]:
    """(module path, kind, leaf name) of every module `add_adapters` may adapt, in order."""
    out = []
    for i, block in enumerate(model.layers):
        for path, module in block.named_modules():
            kind = "routed_experts" if path == "mlp.experts" and isinstance(block.mlp, MoE) else (
                _linear_kind(block, path) if isinstance(module, nn.Linear) else None)
            if kind is not None:
                out.append((f"layers.{i}.{path}", kind, path.rsplit(".", 1)[-1]))
    return out


def unmatched_targets(model: nn.Module, lora: LoraConfig) -> list[str]:
    """The module names among the targets that match no module of `model` (a kind the model does not
    have, such as dense_mlp without dense blocks, is no error), or all the targets if none matches."""
    seen = {name for entry in adaptable_modules(model) for name in entry[1:]}
    items = lora.target_list()
    if not seen & set(items):
        return items
    return [item for item in items if item not in seen and item not in KINDS]


def add_adapters(model: nn.Module, lora: LoraConfig) -> None:
    """Freeze `model` and give its targeted modules adapters (module docstring), in place."""
    fmt = lora.format()
    linear_format = None if fmt is None else fmt.for_linear()
    targets = set(lora.target_list())
    model.adapter_switch = AdapterSwitch()
    for param in model.parameters():
        param.requires_grad_(False)
    for path, kind, leaf in adaptable_modules(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        module = getattr(parent, name)
        rank = lora.rank if kind in targets or leaf in targets else 0
        if kind == "routed_experts":
            setattr(parent, name, AdaptedExperts(module, rank, lora, fmt, model.adapter_switch))
        elif rank or linear_format is not None:
            setattr(parent, name, AdaptedLinear(module, rank, lora, linear_format, model.adapter_switch))
    model.lora = lora


def adapter_init_bound(shape: tuple[int, ...]) -> float:
    """PEFT's A initialisation, kaiming-uniform with a = sqrt(5): uniform in +-1/sqrt(in)."""
    return 1.0 / math.sqrt(shape[-1])


def is_adapter(name: str) -> bool:
    return name.endswith(("lora_A", "lora_B"))


@dataclass(frozen=True)
class FrozenWeight:
    """A frozen base weight of an adapted module: the parameters that hold it and its adapters, each
    named in the model."""

    name: str
    """The weight's own name: its initial values and checkpoint rows are read under it."""
    shape: tuple[int, ...]
    """The weight's shape in the model."""
    fmt: StoredFormat | None
    """Its format; None: held in the compute dtype, as the one parameter `name`."""
    stored: tuple[str, ...]
    """The parameters that hold it: its format's data and scales (`fmt.suffixes`), or itself."""
    transposed: bool
    """The model holds it `[E, in, out]` (gpt-oss's experts), not `[..., out, in]`."""
    adapters: tuple[str, str] | None
    """Its adapters (lora_A, lora_B); None: it has none."""


def _frozen_weights(model: nn.Module) -> Iterator[FrozenWeight]:
    """Every frozen weight of an unwrapped model's adapted modules, in module order: the one walk
    over the adapted modules (`stored_tensors`, `adapted_weights`)."""
    for path, module in model.named_modules():
        if isinstance(module, (AdaptedLinear, AdaptedExperts)):
            yield from module.frozen_weights(path)


@dataclass(frozen=True)
class StoredTensor:
    """A parameter that holds a frozen weight in a published format: which weight, and which of the
    format's tensors it is."""

    weight: str
    """The weight's own name: its initial values and checkpoint rows are read under it."""
    shape: tuple[int, ...]
    """The weight's shape in the model."""
    fmt: StoredFormat
    companion: int
    """Which of the format's stored tensors (0: the data, then the scales)."""
    transposed: bool = False
    """An `[E, out, in]` weight stored in MXFP4 (which stores `x @ P`): quantized as its transpose."""


def stored_tensors(model: nn.Module) -> dict[str, StoredTensor]:
    """Every parameter of an unwrapped model that holds a weight in a format, by name."""
    return {name: StoredTensor(weight.name, weight.shape, weight.fmt, companion,
                               weight.fmt.stores_transposed(weight.transposed))
            for weight in _frozen_weights(model) if weight.fmt is not None
            for companion, name in enumerate(weight.stored)}


def stored_rows(rows, stored: dict[str, StoredTensor], published=None):
    """A row source (`mop.parallel.materialize.RowSource`: `(name, global shape, first, count)` ->
    fp32 rows) that gives the parameters in `stored` as their format stores them: as `published`
    gives them (`(entry, shape, first, count)` -> rows, or None: a checkpoint's own data and scales,
    `mop.models.hf.HFWeights.stored_rows`), else quantized from the weight's rows in `rows` (for a
    matrix, whole blocks of rows around the ones asked for)."""

    def read(name: str, shape, first: int, count: int) -> torch.Tensor:
        entry = stored.get(name)
        if entry is None:
            return rows(name, shape, first, count)
        as_published = published(entry, shape, first, count) if published is not None else None
        if as_published is not None:
            return as_published
        if len(entry.shape) == 3:  # stacked experts: rows are whole experts
            values = rows(entry.weight, entry.shape, first, count)
            return entry.fmt.quantize(values.transpose(1, 2) if entry.transposed else values)[entry.companion]
        block, total = entry.fmt.block[0], entry.shape[0]
        if entry.companion == 0:  # the weight's rows [first, first + count), from whole blocks
            low, high = first // block * block, min(total, -(-(first + count) // block) * block)
            data = entry.fmt.quantize(rows(entry.weight, entry.shape, low, high - low))[0]
            return data[first - low:first - low + count]
        low, high = first * block, min(total, (first + count) * block)  # scale rows are blocks of rows
        return entry.fmt.quantize(rows(entry.weight, entry.shape, low, high - low))[1]

    return read


@dataclass(frozen=True)
class AdaptedWeight:
    """A base weight with adapters: their names and how their product adds to it."""

    lora_a: str
    lora_b: str
    transposed: bool = False
    """The weight is stored `[E, in, out]` (gpt-oss's experts): the update is `(B A)^T` per expert."""


def adapted_weights(model: nn.Module) -> dict[str, AdaptedWeight]:
    """Every weight of an unwrapped adapted model that has adapters, by its name."""
    return {weight.name: AdaptedWeight(*weight.adapters, weight.transposed)
            for weight in _frozen_weights(model) if weight.adapters is not None}


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool) -> torch.Tensor:
    """`weight + scaling B A` (per expert for stacked weights; transposed for an `[E, in, out]` one), in fp32."""
    update = torch.matmul(b.float(), a.float()) * scaling
    return weight.float() + (update.transpose(-1, -2) if transposed else update)
