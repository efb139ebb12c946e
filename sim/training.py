"""The streaming training's events (:class:`Training`): after any change the trainer's
stream is re-evaluated (work assigned, members' modes, its next event), the optimizer step
closes each batch and bumps the version, a drained burst's batch is sealed with what it has;
and the rate at which groups become ready, over the scheduler's window. The batch's state is
``sim.trainer``."""

from __future__ import annotations

from sim.bursts import Bursts
from sim.engine import EPS


class Training(Bursts):
    """The trainer's events, sealing, and the ready rate."""

    def trainer_progress(self) -> None:
        self.trainer.progress(self.loop.now)

    def _trainer_kick(self) -> None:
        """Re-evaluates the stream after any change: assigns work, sets members' modes, and
        schedules the next trainer event."""
        tr = self.trainer
        t = self.loop.now
        tr.progress(t)
        tr.assign()
        self.cancel_unconsumable()
        for c in tr.members:
            busy = tr.work > EPS if tr.optimizing_until < 0 else c in tr.opt_members
            mode = "train" if busy else "idle_train"
            if c.mode != mode:
                c.set_mode(t, mode)
        tr.gen += 1
        if tr.optimizing_until >= 0:
            self.loop.schedule(tr.optimizing_until, self._trainer_event, tr.gen)
        elif tr.members and tr.work > EPS:
            dt = tr.work / (tr.per_cell_rate * len(tr.members))
            self.loop.schedule(t + dt, self._trainer_event, tr.gen)
        elif tr.members and tr.needs == 0 and tr.work <= EPS:
            self._start_optimizer()

    def _start_optimizer(self) -> None:
        tr = self.trainer
        tr.optimizing_until = self.loop.now + self.cc.train_step_fixed_s
        tr.opt_members = list(tr.members)  # the joining window closes here
        for c in tr.members:
            if c.mode != "train":
                c.set_mode(self.loop.now, "train")
        tr.gen += 1
        self.loop.schedule(tr.optimizing_until, self._trainer_event, tr.gen)

    def _trainer_event(self, gen: int) -> None:
        tr = self.trainer
        if gen != tr.gen:
            return
        t = self.loop.now
        if tr.optimizing_until >= 0:
            if t + EPS >= tr.optimizing_until:
                tr.optimizing_until = -1.0
                tr.opt_members = []
                tr.t_last = t
                tr.version += 1
                tr.batch_id += 1
                tr.needs = tr.batch_groups
                tr.work = 0.0
                self.cancel_unconsumable()
                tr.purge_stale()
                self._trainer_kick()
                self.on_update(tr.version)
                self.on_boundary()
            return
        tr.progress(t)
        # The event was scheduled for the work to run out: whatever float residue is left
        # (the clock's resolution at large t can be coarser than the remaining work) is done.
        tr.work = 0.0
        self._trainer_kick()
        self.on_boundary()  # the unassigned supply changed

    def seal_batch(self, batch_id: int) -> bool:
        """Closes the current batch with the groups it has: those already claimed plus the
        ready ones waiting in the pool (a drained burst: no more will come). The optimizer
        step follows once they are trained."""
        tr = self.trainer
        if tr.batch_id != batch_id or tr.needs <= 0:
            return False
        fresh = sum(1 for g in tr.pool if tr.version - g.version <= tr.max_staleness)
        if fresh >= tr.needs:
            return False  # the batch fills from what is ready: nothing to seal
        if fresh == 0 and tr.needs >= tr.batch_groups:
            return False  # an empty batch is not sealed: no update without data
        self.sealed_batches += 1
        tr.needs = fresh
        self._trainer_kick()
        return True

    def ready_rate(self) -> tuple[float, float]:
        """(ready groups per second, training work per ready group in 6N-equivalent tokens) over
        the last ``rate_window_s``
        (the live scheduler measures over its ``rate_window_s`` too); before a whole window
        has passed, over the time since the start."""
        log = self.ready_log
        now = self.loop.now
        while log and log[0][0] < now - self.rate_window_s:
            self.ready_log_tokens -= log.popleft()[1]
        if not log:
            return 0.0, 0.0
        tokens = self.ready_log_tokens / len(log)
        span = min(self.rate_window_s, now)
        if span <= 0:
            return 0.0, tokens
        return len(log) / span, tokens
