"""What the packer's readers see: the supply signal the scheduler follows (WatchSupply: the
ready groups another training cell could still take a share of, what the batch open to
joiners needs, the tokens ready, in the backlog and trained, from which it derives its
rates, whether the optimizer steps) and the conservation counters with the intake's runtime
counts (the metrics and every batch answer carry them). Queries only: nothing here commits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from gyre.ids import GroupId
from services.packer.intake import Intake
from services.packer.records import Batch, Group
from services.packer.state import PackerState


class SupplySignal:
    """The supply signal and the counters, computed from the state on demand."""

    CONTEXT_EVERY_S = 1.0
    """How often the mean open context is measured (a pass over the open executions)."""

    def __init__(
        self, *, state: PackerState, intake: Intake, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.state = state
        self.intake = intake
        self.clock = clock
        self._context: tuple[float, float] = (-math.inf, 0.0)  # (measured at, mean tokens)

    def counters(self) -> dict[str, Any]:
        return {
            **self.state.counters(),
            "late_turns": self.intake.late_turns,
            "turns_replaced": self.intake.turns_replaced,
        }

    def supply(self) -> dict[str, Any]:
        """The training supply of the batch open to joiners (the current one): groups ready
        and not yet fully claimed, i.e. its groups with unclaimed turns plus, while it is
        being filled, the ready groups waiting for it; capped by what it still needs (its
        size less the groups already fully claimed; once sealed, its groups with unclaimed
        turns). This is what another training cell could still take a share of."""
        st = self.state
        batch = st.current_batch()
        open_groups = len(self._groups_with_unclaimed_work(batch))
        if batch.sealed:
            needs = open_groups
        else:
            needs = batch.size - (len(batch.groups) - open_groups)
        waiting = len(st.ready) if batch.id == st.filling and not batch.sealed else 0
        return {
            "ready_groups": min(open_groups + waiting, needs),
            "batch_needs": needs,
            "batch_id": batch.id,
            "dropped": dict(st.dropped),
            "batch_active": batch.active,
            "unclaimed_micro_steps": sum(b.unclaimed for b in st.batches.values() if not b.done),
            "ready_unassigned": len(st.ready),
            "counters": self.counters(),
            "ready_tokens": float(sum(self._group_tokens(st.groups[g]) for g in st.ready)),
            "backlog_tokens": float(self._backlog_tokens()),
            "tokens_trained": float(st.tokens_trained),
            "optimizing": st.optimizing(),
            "batch_assigned": len(batch.groups),
            "groups_ready_total": st.groups_ready_total,
            "groups_filtered": st.groups_filtered,
            "open_context_tokens": self.open_context_tokens(),
        }

    def open_context_tokens(self) -> float:
        """Mean tokens of the latest turn of the open executions that have one (the KV each
        keeps on its engine), to two significant digits; 0 when none is open. Measured at
        most every ``CONTEXT_EVERY_S`` (supply() runs at every record; the pass does not
        need to), and rounded so that the signal does not change at every turn."""
        now = self.clock()
        at, mean = self._context
        if now - at < self.CONTEXT_EVERY_S:
            return mean
        total = n = 0
        for ex in self.state.execs.values():
            if ex.finish is None and ex.turns:
                total += ex.turns[max(ex.turns)].tokens
                n += 1
        mean = float(f"{total / n:.2g}") if n else 0.0
        self._context = (now, mean)
        return mean

    def _groups_with_unclaimed_work(self, batch: Batch) -> set[GroupId]:
        """Groups of ``batch`` with a turn not yet claimed (unpacked, or in a free micro-step)."""
        st = self.state
        out = {st.execs[x].group_id for x, _ in batch.pending}
        for mid in batch.free:
            out.update(st.execs[x].group_id for x, _ in st.micro_steps[mid].seqs)
        return out

    @staticmethod
    def _group_tokens(group: Group) -> int:
        """Packed tokens a group will train, about (each execution's longest turn)."""
        return sum(max((t.tokens for t in ex.turns.values()), default=0) for ex in group.execs.values())

    def _backlog_tokens(self) -> int:
        """Packed tokens assigned to a batch and not trained yet (not packed, or in an
        unacknowledged micro-step)."""
        out = 0
        for b in self.state.batches.values():
            if b.done:
                continue
            out += sum(self.state.segment(r).tokens for r in b.pending)
            out += sum(m.packed_tokens for m in b.micro_steps if m.acked_by is None)
        return out
