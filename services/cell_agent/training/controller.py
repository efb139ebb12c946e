"""The training controller of one elastic cell: joins batches, streams micro-steps from the
packer, reduces gradient sums to the core over the prefix group, and (on the core) takes the
batch's one optimizer step, broadcasts it and publishes the new policy.

The cell agent's servicer calls :meth:`TrainingController.join_batch` for ``JoinBatch`` and
the lifecycle hooks (:meth:`on_enter_training`, :meth:`on_leave_training`, :meth:`close`).

One batch, on every participant (core = index 0, satellites 1..):
  1. join: the core opens the batch at its weight version ``v`` (and exposes snapshot
     ``v``); a satellite registers in index order while the window is open, then pulls
     snapshot ``v`` from the core unless it holds it already, while the core trains on;
  2. stream: claim micro-steps, a few per call (the next call prefetched while the current
     group computes; the group is acked in one call),
     accumulate the sum of token-loss gradients and the token count on version ``v``; when
     the packer says WAIT, wait between micro-steps (never half-way through one);
  3. close: the packer answers CLOSED once every micro-step is claimed; the core freezes
     the membership (the joining window closes), everyone learns the prefix size ``k``;
  4. reduce: gradient sums and [tokens, stale] over the prefix group of size ``k`` to the
     core; the core normalizes by the total tokens, clips, steps once (idempotent per
     batch id, durable before it is announced), then commits the batch at the packer;
  5. share: the core broadcasts [version] and the new weights to the prefix, exposes
     snapshot ``v+1`` and publishes the policy version in etcd.

No training data is lost: the core opens every attempt at a batch at the packer
(``OpenBatch``), which makes the batch's acks leases; they become final only when the core
commits (``CommitBatch``) after its step is durable. An attempt that fails before that (the
core crashed, a collective broke) leaves its micro-steps uncommitted, and the core's next
attempt (it reopens the batch when it is joined to it again) gets every one of them back.
Claims carry an idempotency key, so a retried claim never takes a second micro-step.

The controller is split by concern: this module keeps the lifecycle hooks, joining (step 1:
the core opens the batch, a satellite registers) and the prefix groups' broken state, and
composes the parts, each given what it needs through its constructor:

* :mod:`.claim_loop` - step 2: claims, training and acks of a batch's micro-steps, the
  claims' leases, the core's commit;
* :mod:`.rounds` - steps 3 to 5 on the core and on a satellite (and the satellite's pull);
* :mod:`.outcomes` - what a batch did, and the bounded book of the batches joined;
* :mod:`.params` - the tunables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from gyre.errors import FailedPrecondition, InvalidArgument, Unavailable
from gyre.history import History
from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.claim_loop import BatchLeft, ClaimLoop
from services.cell_agent.training.core import CoreOptimizer
from services.cell_agent.training.outcomes import BatchBook, BatchOutcome
from services.cell_agent.training.params import ControllerParams
from services.cell_agent.training.ports import (
    Collective,
    JoinResult,
    Membership,
    MicroStepSource,
    PolicyPublisher,
    Puller,
)
from services.cell_agent.training.retry import retrying
from services.cell_agent.training.rounds import BatchRounds
from services.cell_agent.training.trainer import Trainer

__all__ = ["BatchOutcome", "ControllerParams", "TrainingController"]

log = logging.getLogger(__name__)


class TrainingController:
    """Drives one cell's part in streaming elastic training."""

    def __init__(
        self,
        *,
        cell_id: str,
        index: int,
        trainer: Trainer,
        snapshots: SnapshotStore,
        source: MicroStepSource,
        membership: Membership,
        collective: Collective,
        publisher: PolicyPublisher | None,
        puller: Puller,
        core: CoreOptimizer | None = None,
        params: ControllerParams | None = None,
        clock: Callable[[], float] = time.monotonic,
        history: History | None = None,
        on_step: Callable[[BatchOutcome], None] | None = None,
    ) -> None:
        """``on_step`` (core only) is called with each applied step's outcome (its
        diagnostics), e.g. by the TensorBoard writer."""
        if (index == 0) != (core is not None):
            raise ValueError("the core (index 0) and only the core owns the optimizer")
        self.cell_id = cell_id
        self.history = history or History()
        """join, train, ack, step, commit, publish: this cell's part (``apps.checker``)."""
        self.index = index
        self.trainer = trainer
        self.snapshots = snapshots
        self.source = source
        self.membership = membership
        self.publisher = publisher
        self.core = core
        self.clock = clock
        params = params or ControllerParams()
        self.book = BatchBook(params)
        self.claims = ClaimLoop(
            source=source,
            trainer=trainer,
            history=self.history,
            params=params,
            clock=clock,
            broken=lambda: self._broken,
            leave=self._leave_early,
        )
        self.rounds = BatchRounds(
            index=index,
            trainer=trainer,
            snapshots=snapshots,
            membership=membership,
            collective=collective,
            publisher=publisher,
            puller=puller,
            core=core,
            claims=self.claims,
            book=self.book,
            params=params,
            clock=clock,
            history=self.history,
            on_step=on_step,
            on_broken=self._break,
        )
        self._params = params
        self._current: asyncio.Task[BatchOutcome] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._broken: str | None = None
        self._last_join: tuple[int, int, int, str] | None = None  # the last JoinBatch that joined
        self._leaving = False
        """The cell was told to leave training (on_leave_training is waiting for its batch)."""

    @property
    def params(self) -> ControllerParams:
        return self._params

    @params.setter
    def params(self, params: ControllerParams) -> None:
        """New parameters reach every part (the next batch runs with them)."""
        self._params = self.book.params = self.claims.params = self.rounds.params = params

    @property
    def is_core(self) -> bool:
        return self.core is not None

    @property
    def version(self) -> int:
        return self.trainer.version

    # Lifecycle hooks -----------------------------------------------------------------

    async def start(self) -> None:
        """Start-up of the core: restore the newest checkpoint (replaying an uncommitted
        step), expose the current weights and re-announce them (idempotent)."""
        if self.core is None:
            return
        restored = await asyncio.to_thread(self.core.restore)
        await asyncio.to_thread(self.snapshots.publish, self.version, self.trainer.state_dict())
        if restored and self.core.last_batch_id:
            # A crash between the step's record and its commit: commit again (idempotent).
            await self.claims.commit(self.core.last_batch_id)
        if restored and self.publisher is not None and self.core.last_batch_id:
            await self.publisher.publish(self.version, self.core.last_batch_id)

    async def on_enter_training(self) -> None:
        """The cell entered TRAINING: nothing to rebuild (groups and model stay alive)."""

    async def on_leave_training(self, timeout_s: float | None = None) -> None:
        """The cell leaves TRAINING: finish (drain) the batch in progress first, unless it is
        the core, alone in a batch it has trained nothing of yet: then it leaves at the next
        WAIT (:meth:`_leave_early`). A breathing core joined the next batch as its
        publication went out and was told to roll out a moment later; draining, it sat
        RETURNING until that batch's groups came in and it had trained them (24-45 s of the
        demo's 4-cell rollout, 3 of 4 returns in one run)."""
        task = self._current
        if task is None or task.done():
            return
        self._leaving = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except BatchLeft:
            log.info("left the batch before its first micro-step", extra={"cell_id": self.cell_id})
        finally:
            self._leaving = False

    async def _leave_early(self, batch_id: int) -> str | None:
        """Why the batch is left now (None: it is not): the cell is leaving training and is
        the core with no satellite in the batch (a satellite's part is awaited by the core's
        reduce, so it drains). The scheduler returns the core only once it is the whole
        training prefix, so no satellite can register between this check and the leave."""
        if not self._leaving or not self.is_core:
            return None
        members = await asyncio.to_thread(self.membership.members, batch_id)
        return "the core leaves training, alone in the batch" if members <= 1 else None

    async def close(self) -> None:
        self._closed = True
        for task in list(self.book.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.book.tasks.values(), return_exceptions=True)

    def status(self) -> dict[str, object]:
        cur = self._current
        return {
            "cell_id": self.cell_id,
            "index": self.index,
            "version": self.version,
            "batch_running": cur is not None and not cur.done(),
            "last_batch_id": self.core.last_batch_id if self.core else max(self.book.outcomes, default=0),
            "broken": self._broken,
        }

    @property
    def broken(self) -> str | None:
        """Why the prefix groups are unusable (a failed collective), or None."""
        return self._broken

    def request_reform(self, why: str) -> None:
        """A peer asked for new prefix groups (a restarted satellite asks the core; the core
        announced a new generation to a satellite): joins are refused from now on, and the
        batch in flight, if any, is abandoned at its next consistent point, between two
        micro-steps and before any collective (its micro-steps go back to the packer with
        the attempt), so that :meth:`repair` can run. Without this, a batch that waits for
        data (the stream's last, partial batch) or a core that joins batch after batch would
        hold the re-formation off, and a restarted satellite would never train again."""
        if self._broken is None:
            self._broken = why
            log.warning("prefix groups to be re-formed", extra={"cell_id": self.cell_id, "why": why})

    def _break(self, why: str) -> None:
        """A collective failed: the prefix groups are unusable until they are re-formed."""
        self._broken = why

    async def repair(self, reform: Callable[[], None]) -> None:
        """Runs ``reform`` (blocking: tear the prefix groups down and form them again) in a
        thread once no batch is in flight, refusing joins meanwhile; clears the broken
        state when it succeeds (and keeps it, raising, when it fails)."""
        async with self._lock:
            cur = self._current
            if cur is not None and not cur.done():
                return  # the batch in flight finishes or fails first
            self._broken = self._broken or "re-forming"
            await asyncio.to_thread(reform)
            log.info("prefix groups re-formed", extra={"cell_id": self.cell_id, "was": self._broken})
            self._broken = None

    async def retry_failed(self) -> bool:
        """Joins again the last batch this cell joined if that attempt failed (abandoned for
        a re-formation, or a broken collective): the scheduler commanded it once and hears
        nothing of the failure (under a continuous policy it commands joins after each new
        version, and none comes without this batch). True when it joined; the core's new
        attempt gets every micro-step back from the packer."""
        last = self._last_join
        if last is None or self._broken is not None:
            return False
        task = self.book.tasks.get(last[0])
        if task is None or not task.done() or (not task.cancelled() and task.exception() is None):
            return False
        log.info("joining again the batch whose attempt failed", extra={"batch_id": last[0]})
        return await self.join_batch(*last)

    async def wait_batch(self, batch_id: int) -> BatchOutcome:
        """The outcome of a batch this cell joined (raises what the batch raised)."""
        task = self.book.tasks.get(batch_id)
        if task is None:
            raise FailedPrecondition(f"batch {batch_id} was not joined here")
        return await asyncio.shield(task)

    # Joining -------------------------------------------------------------------------

    async def join_batch(
        self, batch_id: int, policy_version: int, prefix_size: int, core_target: str
    ) -> bool:
        """Joins batch ``batch_id``. True when this cell trains on it (idempotent); False
        when the joining window had closed, a predecessor never joined, or (core) the
        command names a version newer than the core holds.

        The batch trains on the core's weight version: ``policy_version`` is the caller's
        view of it; an older view (the caller has not seen the last publication yet) does
        not change what is trained, and a satellite always trains on the batch's version
        (pulling it), never on what it held before."""
        if batch_id <= 0 or policy_version < 0 or prefix_size <= 0:
            raise InvalidArgument("batch_id and prefix_size must be > 0, policy_version >= 0")
        if self._closed:
            raise Unavailable("the trainer is shutting down")
        if self._broken is not None:
            raise Unavailable(f"prefix groups broken ({self._broken}); re-forming them, retry")
        if not self.is_core and not core_target:
            raise InvalidArgument("a satellite needs core_target")
        async with self._lock:
            if batch_id <= self.book.forgotten:
                log.info("batch long finished here; not joining", extra={"batch_id": batch_id})
                return False
            if batch_id in self.book.tasks:
                done = self.book.tasks[batch_id]
                if not done.done() or (not done.cancelled() and done.exception() is None):
                    return True
                del self.book.tasks[batch_id]  # that attempt failed (its data went back): a new one
            prev = self._current
            if prev is not None and not prev.done():
                # The previous batch is finishing (step, broadcast): joins follow it. Its
                # own failure is not this call's (it is logged by _log_failure).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(prev), self.params.join_wait_s)
                if not prev.done():
                    return False
                if self._broken is not None:
                    raise Unavailable(f"prefix groups broken ({self._broken}); re-forming them, retry")
            started = self.clock()
            if self.is_core:
                version = await self._open_as_core(batch_id, policy_version)
                if version is None:
                    return False
                coro = self.rounds.run_core(batch_id, version, started)
            else:
                version = await self._register(batch_id)
                if version is None:
                    return False
                if version != policy_version:
                    log.info(
                        "the batch trains on another version than the command named",
                        extra={"batch_id": batch_id, "batch_version": version, "named": policy_version},
                    )
                coro = self.rounds.run_satellite(batch_id, version, core_target, started)
            task = asyncio.create_task(coro, name=f"train.b{batch_id}")
            task.add_done_callback(_log_failure)
            self.book.tasks[batch_id] = task
            self.book.forget_old()
            self._last_join = (batch_id, policy_version, prefix_size, core_target)
            self._current = task
            self.history.append("join", 0, b=batch_id, v=version, index=self.index)
            log.info("joined batch", extra={"batch_id": batch_id, "version": version, "index": self.index})
            return True

    async def _open_as_core(self, batch_id: int, named: int) -> int | None:
        assert self.core is not None
        if batch_id <= self.core.last_batch_id:
            log.info("batch already committed", extra={"batch_id": batch_id})
            return None
        version = self.version
        if named > version:
            log.warning(
                "JoinBatch names a version the core does not hold", extra={"named": named, "have": version}
            )
            return None
        # A new attempt: the packer makes this batch's acks leases until our commit, and hands
        # out again whatever an earlier attempt (lost with a crash or a broken collective) held.
        try:
            await retrying(lambda: self.source.open_batch(batch_id))
        except FailedPrecondition as exc:
            log.warning(
                "the packer refuses to open the batch", extra={"batch_id": batch_id, "error": str(exc)}
            )
            return None
        # Expose v before training on it (a no-op when it is exposed already).
        await asyncio.to_thread(self.snapshots.publish, version, self.trainer.state_dict())
        await asyncio.to_thread(self.membership.open, batch_id, version)
        return version

    async def _register(self, batch_id: int) -> int | None:
        """Registers in index order; the batch's version, or None when not joining."""
        deadline = self.clock() + self.params.join_wait_s
        while True:
            got, version = await asyncio.to_thread(self.membership.register, batch_id, self.index)
            if got is JoinResult.JOINED:
                return version
            if got is not JoinResult.NOT_YET or self.clock() >= deadline:
                log.info("not joining", extra={"batch_id": batch_id, "why": got.value})
                return None
            await asyncio.sleep(0.02)


def _log_failure(task: asyncio.Task[BatchOutcome]) -> None:
    if not task.cancelled() and isinstance(task.exception(), BatchLeft):
        return  # not a failure: logged by on_leave_training
    if not task.cancelled() and task.exception() is not None:
        log.error("batch failed", extra={"task": task.get_name(), "error": repr(task.exception())})
