"""Every group family of a `Layout` and each rank's place in them, for the tests.

`mop.parallel.mesh` builds only what a run uses (its meshes check their own ranks); the tests
compare those groups with this arithmetic: blocks of n consecutive ranks and strided replicas.
"""

from mop.parallel import Layout


def blocks(world: int, n: int) -> list[list[int]]:
    return [list(range(start, start + n)) for start in range(0, world, n)]


def replicas(world: int, n: int) -> list[list[int]]:
    return [list(range(i, world, n)) for i in range(n)]


class LayoutGroups:
    """The group families of `layout` (each a partition of range(world), members ascending)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        w = layout.world
        self.sequence = blocks(w, layout.sequence)  # Ulysses: D ranks sharing one sequence
        self.expert = blocks(w, layout.expert)  # LLEP: Ep ranks exchanging tokens and weights
        self.expert_replica = replicas(w, layout.expert)  # W/Ep ranks FSDP-sharding one partition
        self.vocab = blocks(w, layout.vocab)  # the ring: P ranks holding every vocabulary row
        self.vocab_replica = replicas(w, layout.vocab)  # W/P ranks holding one vocabulary shard

    def of(self, family: str, rank: int) -> list[int]:
        """The group of `family` holding `rank`."""
        return next(group for group in getattr(self, family) if rank in group)

    def index(self, family: str, rank: int) -> int:
        """Which group of `family` holds `rank`."""
        return getattr(self, family).index(self.of(family, rank))
