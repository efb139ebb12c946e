"""Overlapping bursts' rule for unconsumable groups (:class:`Bursts`, ``gyre.staleness``): a
group no batch within the staleness bound can take is cancelled (its ready copy leaves the
pool, its open executions stop and free their slots), or restamped and kept going under the
partial rule; the per-version ledger follows both."""

from __future__ import annotations

from gyre.staleness import goes_on, restamp_version
from services.scheduler.policy import staleness
from sim.engine import ExecState, Execution, Group, VersionLedger
from sim.routing import Routing


class Bursts(Routing):
    """Cancel early, restamp, and cancel groups and executions."""

    def cancel_unconsumable(self) -> int:
        """The rule for unconsumable groups (gyre.staleness), the same for every policy: every
        group that no batch within the staleness bound can take any more is cancelled now (its
        ready copy leaves the pool, its open members are stopped, their slots freed), or, under
        the partial rule, a group with a member started is restamped and goes on. Returns the
        groups cancelled."""
        tr = self.trainer
        lo = staleness.oldest_usable(tr.version, tr.needs == 0, tr.max_staleness)
        gone = [u for u in self.live if u < lo]
        n = 0
        for u in gone:
            for g in list(self.live.pop(u).values()):
                started = any(ex.launched_s >= 0 for ex in g.members)
                new = restamp_version(tr.version, tr.needs == 0, tr.max_staleness)
                moved = new - g.dispatched_version
                if g.closed < g.size and goes_on(self.stale_rule, started, moved, self.partial_max_versions):
                    self._restamp(g, new)
                    continue
                self._cancel_group(g)
                n += 1
        if n:
            self.fill()
        return n

    def _restamp(self, g: Group, version: int) -> None:
        """Moves an open group to ``version`` in the per-version ledger (the partial rule)."""
        old = self.versions[g.version]
        new = self.versions.setdefault(version, VersionLedger())
        launched = sum(1 for ex in g.members if ex.launched_s >= 0)
        for vl, sign in ((old, -1), (new, 1)):
            vl.groups += sign
            vl.dispatched += sign * g.size
            vl.launched += sign * launched
            vl.finished += sign * g.closed
        g.version = version
        self.live.setdefault(version, {})[g.gid] = g
        self.restamped_groups += 1

    def _cancel_group(self, g: Group) -> None:
        tr = self.trainer
        g.cancelled = True
        vl = self.versions[g.version]
        vl.cancelled += 1
        self.cancelled_groups += 1
        if g.closed == g.size:  # ready, in the pool
            if g in tr.pool:
                tr.pool.remove(g)
                tr.pool_tokens -= g.work
            vl.ready -= 1
            return
        for ex in g.members:
            if ex.state is not ExecState.CLOSED:
                self._cancel_exec(ex)

    def _cancel_exec(self, ex: Execution) -> None:
        t = self.loop.now
        vl = self.versions[ex.group.version]
        if ex.state is ExecState.QUEUED:  # counts as launched and closed at once (F <= L)
            self.ledger.launched += 1
            vl.launched += 1
        elif ex.cell is not None:
            c = ex.cell
            c.account(t)
            eng = c.engine
            if ex.xid in eng.active:
                n = eng.leave(ex)
                if n:
                    self._generated(ex, n, eng.version)
                ex.ctx += n
            self._unqueue(eng, ex)
            del c.execs[ex.xid]
            ex.cell = None
            if eng.bounded:
                self._admit_waiting(c)
            self._reschedule(c)
        else:
            try:
                self.homeless.remove(ex)
            except ValueError:
                pass
        ex.state = ExecState.CLOSED
        ex.cancelled = True
        ex.closed_s = t
        ex.token += 1
        self.ledger.finished += 1
        vl.finished += 1
        self.cancelled_executions += 1
