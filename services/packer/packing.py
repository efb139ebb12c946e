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
    bins: list[list[K]] = []
    room: list[int] = []
    for i in order:
        key, size = items[i]
        if size > budget or size < 0:
            raise ValueError(f"item {key!r} of size {size} does not fit a budget of {budget}")
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(key)
                room[b] = free - size
                break
        else:
            bins.append([key])
            room.append(budget - size)
    return bins
