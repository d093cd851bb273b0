"""Where each parameter lives: one record per parameter, computed from the model's shape and the
rank layout alone (no process groups), so that the planner and a run read the same one.

For every parameter of the unwrapped model (by name), a `Placement` says
- its category, as `mop.models.spec` counts them: "expert" (the routed experts' stacked weights),
  "vocabulary" (embedding, output projection) or "dense" (everything else);
- how its rows (dim 0) are cut: first into `partitions` contiguous parts over the ranks of a block
  group (the Ep expert partitions of an expert group, or the P row shards of the vocabulary ring),
  then each part FSDP2-sharded over `fsdp_ranks` ranks (the world for dense weights, the W/Ep
  expert replicas for a partition; 1: not sharded);
- `replicas`: how many ranks hold each element (the vocabulary shard: its W/P vocabulary
  replicas; 1 otherwise), so a global norm counts it once;
- `gradient`: how its gradient is reduced: a reduce-scatter over the world (dense) or over the
  expert replicas (a partition, after LLEP's helpers have returned their parts), an all-reduce
  over the vocabulary replicas (the ring's shard), or nothing (one rank).
The strategies place alike: the mop strategy with its degrees; fsdp2 has no vocabulary ring
(P = 1); the reference is one rank. Readers: the host optimizer and gradient clipping (replicas),
the FSDP2 wrapping of the dense weights (what stays out of it), the checkpoints' global views
(`mop.parallel.views`) and the planner's memory model (`mop.cost.memory`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig
from mop.models.transformer import MoETransformer


@dataclass(frozen=True)
class Placement:
    category: str
    """"dense", "expert" or "vocabulary"."""
    shape: tuple[int, ...]
    """The global (unsharded) shape."""
    partitions: int
    """Contiguous parts the rows are first cut into over a block group (Ep experts' partitions, P
    vocabulary shards); 1: none."""
    fsdp_group: str
    """The group FSDP2 shards each part over: "world", "expert_replica", or "" (kept out of FSDP2)."""
    fsdp_ranks: int
    """Ranks FSDP2 shards each part over (1: not sharded)."""
    replicas: int
    """Ranks holding each element."""
    gradient: str
    """How its gradient is reduced (module docstring)."""

    @property
    def part_rows(self) -> int:
        """Rows of one part, ceil(rows / partitions) (the last part is padded)."""
        return -(-self.shape[0] // self.partitions)

    @property
    def local_rows(self) -> int:
        """The most rows one rank holds (FSDP2 pads a shard to ceil(rows / ranks))."""
        return -(-self.part_rows // self.fsdp_ranks)

    def real_rows(self, part: int) -> int:
        """Rows of part `part` inside the global tensor (the padding cut off)."""
        return rows_in_part(self.shape[0], self.part_rows, part)

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape[1:])


def placements(model: ModelConfig, world: int, expert: int = 1, vocab: int = 1,
               lora: LoraConfig | None = None) -> dict[str, Placement]:
    """Every parameter's placement on `world` ranks with expert groups of `expert` ranks and
    vocabulary groups of `vocab` ranks (1 without the ring); with `lora`, those of the adapted model
    (a routed expert's adapters and stored tensors are placed as its weights are)."""
    return dict(_placements(model, world, expert, vocab, lora))


@functools.lru_cache(maxsize=256)
def _placements(model: ModelConfig, world: int, expert: int, vocab: int,
                lora: LoraConfig | None) -> tuple[tuple[str, Placement], ...]:
    out = []
    for name, shape in _parameter_shapes(model, lora):
        if ".experts." in name and expert > 1:
            replicas = world // expert
            place = Placement("expert", shape, expert, "expert_replica", replicas, 1,
                              _reduce_scatter(replicas, "expert replicas"))
        elif name == "lm_head.weight" and vocab > 1:
            place = Placement("vocabulary", shape, vocab, "", 1, world // vocab, _all_reduce(world // vocab))
        else:
            category = "expert" if ".experts." in name else "vocabulary" if name in VOCABULARY else "dense"
            place = Placement(category, shape, 1, "world", world, 1, _reduce_scatter(world, "world"))
        out.append((name, place))
    return tuple(out)


VOCABULARY = ("embed.weight", "lm_head.weight")


def rows_in_part(total: int, part_rows: int, part: int) -> int:
    """Of `total` rows cut into parts of `part_rows`, those part `part` really holds (a part of pure
    padding holds none)."""
    return max(0, min(part_rows, total - part * part_rows))


def _reduce_scatter(ranks: int, group: str) -> str:
    return f"reduce-scatter over the {group} ({ranks} ranks)" if ranks > 1 else "none"


def _all_reduce(ranks: int) -> str:
    return f"all-reduce over the vocabulary replicas ({ranks} ranks)" if ranks > 1 else "none"


@functools.lru_cache(maxsize=16)
def _parameter_shapes(model: ModelConfig, lora: LoraConfig | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the model built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        full = MoETransformer(model, lora)
    return tuple((name, tuple(param.shape)) for name, param in full.named_parameters())
