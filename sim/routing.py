"""Where executions run (:class:`Routing`): dispatching a burst's groups, filling free rollout
slots (placement's picks), an execution's turns, tool calls, reward and close (a closed group
goes to the trainer), and moving executions between cells: a draining cell's reroutes, the
policy's ``Migrate`` (continuations; KV handoff where enabled) and ``PlanMoves``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.decode import Decoding
from sim.engine import Cell, ExecState, Execution, Group, Role, VersionLedger
from sim.workload import Episode


class Routing(Decoding):
    """Dispatch, placement, turns and closes of executions, and their moves between cells."""

    if TYPE_CHECKING:

        def trainer_progress(self) -> None: ...  # sim.training

        def _trainer_kick(self) -> None: ...  # sim.training

    def dispatch(self, burst: int, version: int, tasks: list[int], episodes: list[list[Episode]]) -> None:
        t = self.loop.now
        vl = self.versions.setdefault(version, VersionLedger())
        live = self.live.setdefault(version, {})
        for task, eps in zip(tasks, episodes):
            g = Group(len(self.groups), task, burst, version, len(eps), dispatched_version=version)
            g.length = sum(ep.total_output for ep in eps)
            self.groups.append(g)
            live[g.gid] = g
            vl.groups += 1
            for ep in eps:
                ex = Execution(len(self.executions), g, ep, dispatched_s=t)
                g.members.append(ex)
                self.executions.append(ex)
                self.queue.append(ex)
                self.ledger.dispatched += 1
                vl.dispatched += 1
        self.fill()

    def fill(self) -> None:
        """Places homeless executions, then launches queued ones, into free rollout slots."""
        homeless, queue = self.homeless, self.queue
        if not homeless and not queue:
            return
        for c in self.placement.picks():
            if homeless:
                self._place(homeless.popleft(), c)
                continue
            while queue and queue[0].state is ExecState.CLOSED:  # cancelled while queued
                queue.popleft()
            if not queue:
                return
            ex = queue.popleft()
            self.versions[ex.group.version].launched += 1
            ex.state = ExecState.SANDBOX
            ex.cell = c
            c.execs[ex.xid] = ex
            ex.launched_s = self.loop.now
            self.ledger.launched += 1
            self.loop.schedule(self.loop.now + ex.ep.sandbox_s, self._turn_arrives, ex)

    def _turn_arrives(self, ex: Execution) -> None:
        if ex.state is ExecState.CLOSED:  # cancelled meanwhile
            return
        c = ex.cell
        if c is None:  # homeless: it will be resumed when placed
            ex.state = ExecState.GPU
            return
        ex.state = ExecState.GPU
        c.account(self.loop.now)
        prompt = ex.ep.prompt_tokens[ex.turn]
        ex.ctx += prompt
        ex.fresh = prompt
        ex.remaining = ex.ep.output_tokens[ex.turn]
        self._admit_or_wait(c, ex)

    def _turn_done(self, ex: Execution) -> None:
        t = self.loop.now
        last = ex.turn >= ex.ep.turns - 1
        if last:
            ex.state = ExecState.REWARD
            self.loop.schedule(t + ex.ep.reward_s, self._close, ex)
        else:
            ex.state = ExecState.TOOL
            delay = ex.ep.tool_s[ex.turn]
            ex.turn += 1
            self.loop.schedule(t + delay, self._turn_arrives, ex)

    def _close(self, ex: Execution) -> None:
        if ex.state is ExecState.CLOSED:  # cancelled meanwhile
            return
        t = self.loop.now
        ex.state = ExecState.CLOSED
        ex.closed_s = t
        if ex.cell is not None:
            del ex.cell.execs[ex.xid]
            ex.cell.engine.uncache(ex)
            ex.cell = None
        elif ex in self.homeless:  # closed (tool or reward done) while waiting for a slot
            self.homeless.remove(ex)
        self.ledger.finished += 1
        g = ex.group
        vl = self.versions[g.version]
        vl.finished += 1
        g.closed += 1
        g.tokens += ex.ctx
        g.work += self.cost.train_work_tokens(ex.ctx)
        if g.closed == g.size:
            g.ready_s = t
            vl.ready += 1
            self.ready_log.append((t, g.work))
            self.ready_log_tokens += g.work
            self.trainer_progress()
            self.trainer.pool.append(g)
            self.trainer.pool_tokens += g.work
            self._trainer_kick()
        self.fill()
        self.on_boundary()

    def _drain(self, src: Cell) -> None:
        """Moves every execution routed to ``src`` elsewhere (continuations)."""
        t = self.loop.now
        src.account(t)
        eng = src.engine
        moving = sorted(src.execs.values(), key=lambda e: e.xid)
        for ex in moving:
            self._detach(src, ex)
            self.reroutes += 1
            ex.reroutes += 1
            dst = self.placement.pick()
            if dst is None:
                self.homeless.append(ex)
            else:
                self._place(ex, dst)
        eng.heap.clear()
        eng.stalls.clear()
        eng.stall_total = 0.0
        eng.waiting.clear()
        eng.cached.clear()
        eng.cached_total = 0
        eng.rate = None
        eng.gen += 1

    def _detach(self, src: Cell, ex: Execution) -> None:
        """Takes ``ex`` off ``src`` (its request cancelled at the engine: the tokens
        generated so far count and become context the destination continues from)."""
        eng = src.engine
        if ex.xid in eng.active:
            n = eng.leave(ex)
            if n:
                self._generated(ex, n, eng.version)
            ex.ctx += n
            ex.remaining -= n
        self._unqueue(eng, ex)
        del src.execs[ex.xid]
        ex.cell = None

    def _place(self, ex: Execution, dst: Cell) -> None:
        t = self.loop.now
        ex.cell = dst
        dst.execs[ex.xid] = ex
        dst.account(t)
        if self.cc.kv_handoff and ex.ctx > 0:
            handoff_s = self.cost.kv_handoff_s(ex.ctx)
            dst.engine.add_stall("prefill", handoff_s)
            self.kv_handoffs += 1
            self.reroute_gpu_s += handoff_s
            dst.engine.cache(ex)  # the moved KV is there, as a cached prefix
        elif ex.ctx > 0:
            ex.recompute = True
        if ex.state is ExecState.GPU:
            if ex.remaining > 0:  # continuation of the cancelled request
                self._admit_or_wait(dst, ex)
            else:  # was homeless before its turn arrived
                self._turn_arrives(ex)

    def migrate(self, xid: int, cid: str) -> bool:
        """Moves one live execution to rollout cell ``cid`` as a continuation (the reroute a
        draining cell uses, KV handoff where enabled). False when it cannot (closed, not
        routed, same cell, destination not in rollout or full)."""
        if not 0 <= xid < len(self.executions):
            return False
        ex = self.executions[xid]
        src = ex.cell
        dst = self._by_id.get(cid)
        if (
            ex.state is ExecState.CLOSED
            or src is None
            or dst is None
            or dst is src
            or dst.role is not Role.ROLLOUT
            or dst.free <= 0
        ):
            return False
        src.account(self.loop.now)
        self._detach(src, ex)
        self.migrations += 1
        ex.reroutes += 1
        self._place(ex, dst)
        if src.engine.bounded:
            self._admit_waiting(src)
        self._reschedule(src)
        return True

    def plan_moves(self, cids: tuple[str, ...]) -> bool:
        """Placement keeps the planned cells free while other rollout cells have room."""
        new = frozenset(cids)
        if new == self.placement.avoid:
            return False
        self.placement.avoid = new
        return True
