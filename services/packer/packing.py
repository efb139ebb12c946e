"""Token-budget bin packing of sequences into micro-steps: first-fit decreasing."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def first_fit_decreasing(items: Sequence[tuple[K, int]], budget: int) -> list[list[K]]:
    """Packs ``(key, size)`` items into bins of capacity ``budget``.

    Items are placed longest first, each into the first bin with room (FFD uses at most
    11/9 OPT + 6/9 bins). Ties keep input order, so the result is deterministic. Every item
    must fit on its own (size <= budget); sizes must be >= 0.
    """
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    # The first bin with room, found in O(log n) rather than by scanning every bin: a max
    # tree over the rooms of n bins (at most one per item), those not opened yet holding a
    # whole budget, so the first leaf with room is an open bin, or else the next new one.
    cap = 1
    while cap < len(items):
        cap *= 2
    tree = [budget] * (2 * cap)
    bins: list[list[K]] = []
    for i in order:
        key, size = items[i]
        if size > budget or size < 0:
            raise ValueError(f"item {key!r} of size {size} does not fit a budget of {budget}")
        node = 1
        while node < cap:
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        b = node - cap
        if b == len(bins):
            bins.append([key])
        else:
            bins[b].append(key)
        tree[node] -= size
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node //= 2
    return bins
