"""Least-loaded expert parallelism (LLEP) planner: which rank computes which tokens of which expert.

Experts 0..E-1 are partitioned contiguously over the Ep ranks of an expert group: expert e is
native to rank `e // (E // Ep)`. The input is the all-reduced token count of every expert (plain
ints, e.g. `counts.tolist()`), so every rank computes the same plan on its own (no broadcast).
The planner is pure Python: no randomness, no dict/set iteration order, ties broken by expert or
rank index.

A plan is a list of slices `(expert, rank, start, stop)`: rank `rank` computes tokens
`[start, stop)` of the expert's global token order (the order the dispatch sorts tokens into).

Gate (paper Alg. 4): when Ep == 1, there are no tokens, or `max(loads) / mean(loads) < gate`
(mean over all E experts), the plan is standard EP: one slice `[0, load)` per expert with load,
on its native rank.

Otherwise, least-loaded assignment (paper Alg. 2, LLA) with spill (Alg. 3, LLAS):
- capacity `m_alpha = ceil(alpha * total / Ep)`; the ceiling keeps token counts integral and,
  for alpha >= 1, the ranks' summed capacity at least the total.
- per rank: pending load `g_p` (its native experts not yet placed; starts as its native load)
  and assigned load `g_a` (tokens placed on it so far). `room(o) = m_alpha - g_a[o] - g_p[o]`:
  a rank reserves capacity for its own pending experts before accepting foreign tokens.
- experts by load descending (ties: lower index first; zero loads skipped). For expert e of
  native rank n and load L: `g_p[n] -= L`; the native rank takes `min(L, room(n))` tokens when
  `room(n) > 0` (cases 1 and 2), the rest spills (case 3 when `room(n) <= 0`: all of it).
- spill of the remainder r: scan the other ranks by `(g_a + g_p, rank)`; the first whose
  chunk `c = min(r, room(o))` is at least `min_chunk` tokens, or is the whole remainder, takes
  `c`; rescan until r == 0. When no rank qualifies, the least-loaded other rank takes the whole
  remainder as a *forced* slice (a chunk under min_chunk is not worth its GEMM and weight
  transfer, so the paper accepts exceeding capacity instead).

Invariants of every plan:
- coverage: the slices of an expert with load > 0 are non-empty and tile `[0, load)` in order;
  zero-load experts have none. Slices are sorted by (expert, start).
- capacity: a rank holding no forced slice computes at most m_alpha tokens (each non-forced
  slice fits the rank's room, and room <= m_alpha - g_a). Only forced slices can push a rank
  over m_alpha; a forced slice always exceeds the rank's room when placed, yet the rank may end
  within m_alpha if its own pending experts later spill elsewhere. The native rank's share of
  its own expert is never forced. With alpha >= 1 and min_chunk == 1 nothing is ever forced.
- chunking: a non-forced slice off the native rank has >= min_chunk tokens or ends the expert.
- a helper may hold two slices of one expert: one filling its room, then the forced remainder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Slice:
    """Tokens `[start, stop)` of `expert`'s global token order, computed by `rank`."""

    expert: int
    rank: int  # rank within the expert group that computes this slice
    start: int  # offset into the expert's global token order
    stop: int  # exclusive
    forced: bool  # placed beyond the rank's capacity (paper Alg. 3, forced assignment)


@dataclass(frozen=True)
class Plan:
    """Where every routed token of one expert group is computed; equal on every rank."""

    experts: int
    ranks: int
    slices: tuple[Slice, ...]  # sorted by (expert, start)
    balanced: bool  # True when the gate chose plain EP
    capacity: int | None  # m_alpha; None for plain EP

    def native(self, expert: int) -> int:
        return expert // (self.experts // self.ranks)

    def rank_loads(self) -> list[int]:
        """Tokens computed per rank."""
        loads = [0] * self.ranks
        for s in self.slices:
            loads[s.rank] += s.stop - s.start
        return loads

    def transfers(self) -> list[tuple[int, int, int]]:
        """Sorted unique `(expert, native_rank, helper_rank)`: the expert weights to ship."""
        triples = {(s.expert, self.native(s.expert), s.rank) for s in self.slices}
        return sorted(t for t in triples if t[1] != t[2])

    def slices_of(self, expert: int) -> list[Slice]:
        return list(self._by_expert.get(expert, ()))

    @cached_property
    def _by_expert(self) -> dict[int, list[Slice]]:
        # Routing asks for every expert's slices once per source rank: an index keeps that
        # O(E + slices) per source, not O(E x slices).
        index: dict[int, list[Slice]] = {}
        for s in self.slices:
            index.setdefault(s.expert, []).append(s)
        return index

    def compute_experts(self, rank: int) -> list[int]:
        """Experts this rank computes tokens of, native and foreign, ascending."""
        return sorted({s.expert for s in self.slices if s.rank == rank})


def imbalance(loads: Sequence[int]) -> float:
    """max / mean of the loads (mean over all experts); 1.0 when there are no tokens."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def plan_ep(loads: Sequence[int], ranks: int) -> Plan:
    """Standard EP: every expert's tokens on its native rank."""
    per_rank = _experts_per_rank(loads, ranks)
    slices = tuple(Slice(e, e // per_rank, 0, load, False) for e, load in enumerate(loads) if load > 0)
    return Plan(len(loads), ranks, slices, balanced=True, capacity=None)


def plan_llep(
    loads: Sequence[int], ranks: int, *, gate: float = 1.3, alpha: float = 1.0, min_chunk: int = 1024
) -> Plan:
    """LLA with LLAS spill behind the imbalance gate (see the module docstring)."""
    per_rank = _experts_per_rank(loads, ranks)
    assert alpha > 0 and min_chunk >= 1, (alpha, min_chunk)  # min_chunk >= 1 rules out empty slices
    total = sum(loads)
    if ranks == 1 or total == 0 or imbalance(loads) < gate:
        return plan_ep(loads, ranks)
    capacity = math.ceil(alpha * total / ranks)
    native_loads = [sum(loads[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]
    ledger = _Ledger(capacity, assigned=[0] * ranks, pending=native_loads)
    for e in sorted((e for e, load in enumerate(loads) if load > 0), key=lambda e: (-loads[e], e)):
        _place(ledger, e, e // per_rank, loads[e], min_chunk)
    slices = tuple(sorted(ledger.slices, key=lambda s: (s.expert, s.start)))
    return Plan(len(loads), ranks, slices, balanced=False, capacity=capacity)


def _experts_per_rank(loads: Sequence[int], ranks: int) -> int:
    assert ranks >= 1 and len(loads) >= 1 and len(loads) % ranks == 0, (len(loads), ranks)
    assert all(load >= 0 for load in loads), loads
    return len(loads) // ranks


@dataclass
class _Ledger:
    """The running per-rank loads of LLA and the slices placed so far."""

    capacity: int
    assigned: list[int]  # g_a
    pending: list[int]  # g_p
    slices: list[Slice] = field(default_factory=list)

    def room(self, rank: int) -> int:
        return self.capacity - self.assigned[rank] - self.pending[rank]

    def assign(self, expert: int, rank: int, start: int, stop: int, forced: bool = False) -> None:
        self.slices.append(Slice(expert, rank, start, stop, forced))
        self.assigned[rank] += stop - start


def _place(ledger: _Ledger, expert: int, native: int, load: int, min_chunk: int) -> None:
    """Alg. 2 for one expert: the native rank takes what fits, the rest spills."""
    ledger.pending[native] -= load  # its tokens are placed now, no longer reserved
    native_share = max(0, min(load, ledger.room(native)))
    if native_share:
        ledger.assign(expert, native, 0, native_share)
    _spill(ledger, expert, native, native_share, load, min_chunk)


def _spill(ledger: _Ledger, expert: int, native: int, offset: int, load: int, min_chunk: int) -> None:
    """Alg. 3: tokens `[offset, load)` go to the least-loaded other ranks."""
    while offset < load:
        remaining = load - offset
        others = sorted(
            (o for o in range(len(ledger.assigned)) if o != native),
            key=lambda o: (ledger.assigned[o] + ledger.pending[o], o),
        )
        for o in others:
            chunk = min(remaining, ledger.room(o))
            # A chunk under min_chunk is only worth its GEMM when it finishes the expert (then
            # chunk == remaining > 0); a full rank (chunk <= 0) is skipped as min_chunk >= 1.
            if chunk >= min_chunk or chunk == remaining:
                ledger.assign(expert, o, offset, offset + chunk)
                offset += chunk
                break
        else:
            ledger.assign(expert, others[0], offset, load, forced=True)
            offset = load
