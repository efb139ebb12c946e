"""Micro-step building: a batch's trajectory segments bin-packed under the token budget
(first-fit decreasing, a pure function), the ``emit`` events that make the bins micro-steps,
and the sequences a claim hands out, with their wire forms (:class:`Packing`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from gyre.ids import BatchId
from services.packer.config import PackerConfig
from services.packer.journal import Journal
from services.packer.model import MicroStepView, PackedSequence, WireCache
from services.packer.records import Batch, MicroStep
from services.packer.segments import Segment, split_segments

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


class Packing:
    """Packs assigned segments into micro-steps; builds the views and sequences claims answer."""

    def __init__(self, *, cfg: PackerConfig, journal: Journal) -> None:
        self.cfg = cfg
        self.journal = journal
        self.state = journal.state
        # Wire forms of the sequences of ready groups (config pre_encode): claims answer
        # from them instead of building protos (services.packer.model.WireCache).
        self.wire = WireCache()

    def pack(self, batch: Batch, flush: bool) -> None:
        """First-fit decreasing over the batch's unpacked segments (each costs all its tokens
        once); emits bins that are full enough (or every bin when ``flush``); the rest wait
        for more sequences."""
        if not batch.pending:
            return
        st, budget = self.state, self.cfg.micro_step_token_budget
        sizes = {ref: st.segment_tokens(ref) for ref in batch.pending}
        bins = first_fit_decreasing([(ref, sizes[ref]) for ref in batch.pending], budget)
        threshold = self.cfg.emit_fill_fraction * budget
        emitted = len(batch.micro_steps)
        for refs in bins:
            if flush or sum(sizes[r] for r in refs) >= threshold:
                self.journal.commit(
                    {
                        "t": "emit",
                        "b": batch.id,
                        "ms": f"b{batch.id}-m{emitted}",
                        "seqs": [[x, i] for x, i in refs],
                    }
                )
                emitted += 1

    def pre_encode(self, execution_ids: Iterable[str]) -> None:
        """With ``pre_encode``, the wire forms of a group that just became ready: encoded
        now, while rollouts arrive, rather than on the claim path; the same segments the
        group's assignment will cut (split_segments of the same turns)."""
        if not self.cfg.pre_encode:
            return
        for x in execution_ids:
            turns = self.state.execs[x].turns
            for indexes in split_segments(turns):
                self.wire.put(self.sequence(x, indexes))

    def forget_gone(self) -> None:
        """The wire forms of executions trained or dropped go."""
        self.wire.keep(self.state.execs)

    def view(self, ms: MicroStep, batch: Batch) -> MicroStepView:
        st = self.state
        seqs = tuple(self.sequence(x, st.execs[x].segments[i]) for x, i in ms.seqs)
        return MicroStepView(
            ms.id, BatchId(batch.id), batch.version or 0, seqs, ms.loss_tokens, ms.packed_tokens
        )

    def sequence(self, execution_id: str, indexes: tuple[int, ...]) -> PackedSequence:
        """The packed sequence of one segment (turn ``indexes`` of a ready execution)."""
        ex = self.state.execs[execution_id]
        segment = Segment(tuple(ex.turns[i] for i in indexes))
        fallback = ex.finish.policy_version if ex.finish is not None else 0
        advantage = self.state.groups[ex.group_id].advantages[execution_id]
        return PackedSequence(segment, advantage, segment.oldest_version(fallback))
