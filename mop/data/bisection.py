"""Bisections over lengths whose test compares slices, which run in C: log(n) comparisons where a
loop over characters or messages would take n steps in Python (a long-context row's texts hold
hundreds of thousands of characters)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def largest_holding(most: int, holds: Callable[[int], bool]) -> int:
    """The largest n in [0, most] for which `holds(n)`, which holds for every smaller n where it holds."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


def common_prefix(a: Sequence, b: Sequence, limit: int | None = None) -> int:
    """The length of the longest common prefix of two strings or lists, `limit` at most (no more
    than the shorter one's length, which it is by default)."""
    most = min(len(a), len(b)) if limit is None else limit
    return largest_holding(most, lambda n: a[:n] == b[:n])
