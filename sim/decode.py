"""The engines' side of the mechanism (:class:`Decoding`): a turn's admission under the KV
capacity (first in first out), its prefill (what a cached prefix, a reroute, an eviction or a
preemption leaves to compute), recompute preemption when the running sequences fill the KV,
and the decode events: each engine's next finish, scheduled from the fluid decode model, and
what a finish does to the engine. What a finished turn leads to is ``sim.routing``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.cluster_state import ClusterState
from sim.engine import Cell, Engine, Execution


class Decoding(ClusterState):
    """KV admission, prefill, preemption and the decode events of every engine."""

    if TYPE_CHECKING:

        def _turn_done(self, ex: Execution) -> None: ...  # sim.routing

    def _admit_or_wait(self, c: Cell, ex: Execution) -> None:
        """Admits ``ex``'s turn on ``c`` if its context fits the KV (behind any earlier
        waiter), else queues it."""
        eng = c.engine
        if eng.bounded and (eng.waiting or not eng.fits(ex.ctx)):
            ex.waiting = True
            eng.waiting.append(ex)
            return
        self._admit(c, ex)
        self._reschedule(c)

    def _admit(self, c: Cell, ex: Execution) -> None:
        """Prefills what ``ex``'s KV on ``c`` lacks (the new tokens after a cached prefix; the
        whole context after a reroute, an eviction or a preemption) and starts its decode."""
        eng = c.engine
        prefix = ex.ctx - ex.fresh
        hit = eng.uncache(ex) or not eng.bounded
        if ex.recompute:  # rerouted: its KV is on another engine
            p = self.cost.prefill_s(ex.ctx, 0)
            self.reroute_recompute_tokens += prefix
            self.reroute_gpu_s += p - self.cost.prefill_s(ex.fresh, prefix)
            ex.recompute = False
        elif not hit and prefix > 0:  # evicted while on a tool, or preempted
            p = self.cost.prefill_s(ex.ctx, 0)
            self.kv_recompute_tokens += prefix
            self.kv_recompute_gpu_s += p - self.cost.prefill_s(ex.fresh, prefix)
        else:
            p = self.cost.prefill_s(ex.fresh, prefix)
        eng.add_stall("prefill", p)
        ex.fresh = 0
        eng.join(ex)
        if eng.bounded:
            self.kv_evictions += eng.trim()

    def _admit_waiting(self, c: Cell) -> None:
        """Admits queued turns, first come first served, while they fit."""
        eng = c.engine
        while eng.waiting and eng.fits(eng.waiting[0].ctx):
            ex = eng.waiting.popleft()
            ex.waiting = False
            self._admit(c, ex)

    def _preempt(self, c: Cell) -> None:
        """The running sequences' KV reached the capacity: preempts the youngest (the last
        admitted) until the rest fit, as vLLM's recompute preemption does. A preempted
        sequence keeps its generated tokens as context, loses its KV and goes to the front of
        the queue; its readmission prefills the whole context again."""
        eng = c.engine
        first = True
        while len(eng.active) > 1 and (first or eng.running_tokens() > eng.cap):
            first = False
            ex = next(reversed(eng.active.values()))
            n = eng.leave(ex)
            if n:
                self._generated(ex, n, eng.version)
            ex.ctx += n
            ex.remaining -= n
            ex.waiting = True
            eng.waiting.appendleft(ex)
            self.preemptions += 1

    def _reschedule(self, c: Cell) -> None:
        """Schedules the engine's next finish (the decode time to the next finish, inlined: the hot path)."""
        eng = c.engine
        eng.gen += 1
        fv = eng.next_finish_v()
        if fv is None:
            return
        n = len(eng.active)
        rate = eng.rate
        if rate is None:
            eng.rate_base = eng.v
            rate = eng.rate = self.cost.decode_rate(n, eng.a + n * eng.v)
        full = False  # the next event is the KV filling up, not a finish
        if eng.bounded and n > 1:
            v_full = (eng.cap - eng.a) / n  # running_tokens() reaches the capacity
            if v_full < fv:
                fv = max(v_full, eng.v)
                full = True
        base = eng.rate_base
        t = self.loop.now + (eng.stall_total if eng.stalls else 0.0) + rate.time(eng.v - base, fv - base)
        self.loop.schedule(t, self._engine_event, c, eng.gen, full)

    def _engine_event(self, c: Cell, gen: int, full: bool = False) -> None:
        eng = c.engine
        if gen != eng.gen or c.mode != "rollout":
            return
        c.account(self.loop.now)
        if full:
            self._preempt(c)
        else:
            version = eng.version
            for ex in eng.take_finished():  # V snaps to the first finish: float slack
                eng.remove(ex)
                n = ex.remaining
                self._generated(ex, n, version)
                ex.ctx += n
                ex.remaining = 0
                if eng.bounded and ex.turn < ex.ep.turns - 1:
                    eng.cache(ex)
                self._turn_done(ex)
            if eng.bounded:
                self._admit_waiting(c)
                self.kv_evictions += eng.trim()
        self._reschedule(c)

    def _generated(self, ex: Execution, n: int, version: int) -> None:
        gv = ex.group.gen_by_version
        gv[version] = gv.get(version, 0) + n
        if ex.cell is not None:
            ex.cell.engine.tokens += n

    @staticmethod
    def _unqueue(eng: Engine, ex: Execution) -> None:
        """Takes ``ex`` out of ``eng``'s admission queue and prefix cache (it leaves)."""
        if ex.waiting:
            eng.waiting.remove(ex)
            ex.waiting = False
        eng.uncache(ex)
