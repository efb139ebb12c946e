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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from gyre import heap
from gyre.errors import FailedPrecondition, GyreError, InvalidArgument, NotFound, Unavailable
from gyre.history import History
from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.core import CoreOptimizer, failpoint
from services.cell_agent.training.microstep import Claim, Outcome
from services.cell_agent.training.ports import (
    Collective,
    JoinResult,
    Membership,
    MicroStepSource,
    PolicyPublisher,
    Puller,
)
from services.cell_agent.training.retry import keep_claims, retrying
from services.cell_agent.training.trainer import LossStats, Trainer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ControllerParams:
    claim_wait_s: float = 1.0
    join_wait_s: float = 10.0
    collective_timeout_s: float = 600.0
    prefetch: bool = True
    keep_claims_every_s: float = 2.0  # at most; a third of the packer's claim TTL when shorter
    claim_batch: int = 4  # micro-steps per ClaimMicroSteps call, acked together
    keep_batches: int = 16
    """The newest batches whose task and outcome the controller keeps (a redelivered
    JoinBatch, ``wait_batch``, ``status``); older finished ones are forgotten, so a run of
    days holds a bounded state, and a JoinBatch for one of them answers not joined."""
    release_heap: bool = True
    """After each batch, return the heap it freed to the system (:mod:`gyre.heap`)."""


@dataclasses.dataclass
class BatchOutcome:
    """What one batch did on this cell."""

    batch_id: int
    base_version: int
    new_version: int = 0
    prefix_size: int = 0
    local_tokens: int = 0
    local_micro_steps: int = 0
    total_tokens: int = 0  # core only
    stale_participants: int = 0  # core only: satellites that contributed nothing
    applied: bool = False
    stale: bool = False  # satellite: could not hold version base_version
    joined_s: float = 0.0  # satellite: join → weights ready (pull) seconds
    first_micro_step_s: float = 0.0  # join → first micro-step accumulated
    seconds: float = 0.0
    diagnostics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Core only: the batch's loss diagnostics over every participant's tokens
    (:meth:`LossStats.summary`) and the gradient norm before clipping."""


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
        self.collective = collective
        self.publisher = publisher
        self.puller = puller
        self.core = core
        self.on_step = on_step
        """Core only: called with each applied step's outcome (its diagnostics), e.g. by
        the TensorBoard writer."""
        self.params = params or ControllerParams()
        self.clock = clock
        self.outcomes: dict[int, BatchOutcome] = {}
        self._tasks: dict[int, asyncio.Task[BatchOutcome]] = {}
        self._current: asyncio.Task[BatchOutcome] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._keep_every_s = self.params.keep_claims_every_s
        self._broken: str | None = None
        self._last_join: tuple[int, int, int, str] | None = None  # the last JoinBatch that joined
        self._claimed_at: dict[str, float] = {}
        self._forgotten = 0  # the newest batch id whose task was dropped (see keep_batches)

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
            await self._commit(self.core.last_batch_id)
        if restored and self.publisher is not None and self.core.last_batch_id:
            await self.publisher.publish(self.version, self.core.last_batch_id)

    async def on_enter_training(self) -> None:
        """The cell entered TRAINING: nothing to rebuild (groups and model stay alive)."""

    async def on_leave_training(self, timeout_s: float | None = None) -> None:
        """The cell leaves TRAINING: finish (drain) the batch in progress first."""
        task = self._current
        if task is not None and not task.done():
            await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def status(self) -> dict[str, object]:
        cur = self._current
        return {
            "cell_id": self.cell_id,
            "index": self.index,
            "version": self.version,
            "batch_running": cur is not None and not cur.done(),
            "last_batch_id": self.core.last_batch_id if self.core else max(self.outcomes, default=0),
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
        task = self._tasks.get(last[0])
        if task is None or not task.done() or (not task.cancelled() and task.exception() is None):
            return False
        log.info("joining again the batch whose attempt failed", extra={"batch_id": last[0]})
        return await self.join_batch(*last)

    async def wait_batch(self, batch_id: int) -> BatchOutcome:
        """The outcome of a batch this cell joined (raises what the batch raised)."""
        task = self._tasks.get(batch_id)
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
            if batch_id <= self._forgotten:
                log.info("batch long finished here; not joining", extra={"batch_id": batch_id})
                return False
            if batch_id in self._tasks:
                done = self._tasks[batch_id]
                if not done.done() or (not done.cancelled() and done.exception() is None):
                    return True
                del self._tasks[batch_id]  # that attempt failed (its data went back): a new one
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
                coro = self._run_core(batch_id, version, started)
            else:
                version = await self._register(batch_id)
                if version is None:
                    return False
                if version != policy_version:
                    log.info(
                        "the batch trains on another version than the command named",
                        extra={"batch_id": batch_id, "batch_version": version, "named": policy_version},
                    )
                coro = self._run_satellite(batch_id, version, core_target, started)
            task = asyncio.create_task(coro, name=f"train.b{batch_id}")
            task.add_done_callback(_log_failure)
            self._tasks[batch_id] = task
            self._forget_old()
            self._last_join = (batch_id, policy_version, prefix_size, core_target)
            self._current = task
            self.history.append("join", 0, b=batch_id, v=version, index=self.index)
            log.info("joined batch", extra={"batch_id": batch_id, "version": version, "index": self.index})
            return True

    def _forget_old(self) -> None:
        """Drops the tasks and outcomes of finished batches older than the newest
        ``keep_batches``. Before, every batch's task (its coroutine, its outcome and the
        diagnostics; a failed one's traceback with its frames' tensors) stayed for the life
        of the process: a few KB more per batch, without end."""
        keep = max(1, self.params.keep_batches)
        for b in sorted(self._tasks)[: max(0, len(self._tasks) - keep)]:
            if self._tasks[b].done():
                del self._tasks[b]
                self._forgotten = max(self._forgotten, b)
        for b in sorted(self.outcomes)[: max(0, len(self.outcomes) - keep)]:
            del self.outcomes[b]

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

    # One batch -----------------------------------------------------------------------

    async def _run_core(self, batch_id: int, version: int, started: float) -> BatchOutcome:
        try:
            out = await self._core_batch(batch_id, version, started)
        except BaseException:
            self.trainer.close_window()  # a failed batch leaves no gradient behind
            raise
        await self._release_heap()
        return out

    async def _run_satellite(
        self, batch_id: int, version: int, core_target: str, started: float
    ) -> BatchOutcome:
        try:
            out = await self._satellite_batch(batch_id, version, core_target, started)
        except BaseException:
            self.trainer.close_window()
            raise
        await self._release_heap()
        return out

    async def _release_heap(self) -> None:
        """Hands the memory the batch freed back to the system (see :mod:`gyre.heap`):
        without it the allocator kept it resident, and the core's RSS crept up for hours."""
        if self.params.release_heap:
            await asyncio.to_thread(heap.release_free_heap)

    async def _collective(
        self, op: Callable[[int, torch.Tensor], None], k: int, tensor: torch.Tensor
    ) -> None:
        """One collective; a failure (a peer died, a timeout) breaks the prefix groups."""
        try:
            await asyncio.to_thread(op, k, tensor)
        except Exception as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            log.error(
                "collective failed: the prefix groups are broken until they are re-formed",
                extra={"prefix": k, "error": self._broken},
            )
            raise Unavailable(f"collective over the prefix of {k} failed: {exc}") from exc

    async def _core_batch(self, batch_id: int, version: int, started: float) -> BatchOutcome:
        assert self.core is not None
        out = BatchOutcome(batch_id, version)
        self.trainer.open_window(version)
        await self._consume(batch_id, version, out, started)
        failpoint("training.before_reduce")  # every micro-step acked, nothing durable yet
        # 3. Close the joining window.
        k = await asyncio.to_thread(self.membership.freeze, batch_id)
        out.prefix_size = k
        # 4. Reduce to the core, step once.
        grad = self.trainer.flat_grads()
        header, peak = self._header(stale=False, device=grad.device)
        if k > 1:
            await self._collective(self.collective.reduce_to_core, k, grad)
            await self._collective(self.collective.reduce_to_core, k, header)
            await self._collective(functools.partial(self.collective.reduce_to_core, op="max"), k, peak)
        out.total_tokens, out.stale_participants = int(header[0].item()), int(header[1].item())
        stats = LossStats.from_tensors(header[2:], float(peak[0].item()))
        result = await asyncio.to_thread(self.core.step, batch_id, grad, out.total_tokens)
        self.trainer.close_window()
        out.new_version, out.applied = result.version, result.applied
        out.diagnostics = {**stats.summary(), "grad_norm": result.grad_norm}
        self.history.append(
            "step",
            0,
            b=batch_id,
            v=version,
            new_v=result.version,
            applied=result.applied,
            diag=out.diagnostics,
        )
        if self.on_step is not None and result.applied:
            await asyncio.to_thread(self.on_step, out)
        failpoint("training.before_commit")
        await self._commit(batch_id)  # the step is durable: the micro-steps are trained for good
        # 5. Share: broadcast to the prefix, expose, publish.
        if k > 1:
            # The step is committed: a satellite lost now does not stop its publication.
            with contextlib.suppress(Unavailable):
                await self._collective(
                    self.collective.broadcast_from_core,
                    k,
                    torch.tensor([float(result.version)], dtype=torch.float64, device=grad.device),
                )
                await self._collective(
                    self.collective.broadcast_from_core, k, self.trainer.flat_params().contiguous()
                )
        await asyncio.to_thread(self.snapshots.publish, result.version, self.trainer.state_dict())
        if self.publisher is not None and result.applied:
            await self.publisher.publish(result.version, batch_id, out.diagnostics)
            self.history.append("publish", 0, b=batch_id, v=result.version)
        out.seconds = self.clock() - started
        self.outcomes[batch_id] = out
        self._forget_old()
        log.info("batch stepped", extra=dataclasses.asdict(out))
        return out

    async def _satellite_batch(
        self, batch_id: int, version: int, core_target: str, started: float
    ) -> BatchOutcome:
        out = BatchOutcome(batch_id, version)
        # 1. Hold version v: pull it from the core unless this cell has it already.
        if self.trainer.version != version:
            try:
                got, state = await self.puller(core_target, version)
                if got != version:
                    raise FailedPrecondition(f"pulled version {got}, wanted {version}")
                await asyncio.to_thread(self.trainer.load_state, state, version)
            except (GyreError, OSError) as exc:
                log.warning(
                    "cannot hold the batch's version; contributing nothing", extra={"error": repr(exc)}
                )
                out.stale = True
        out.joined_s = self.clock() - started
        if not out.stale:
            self.trainer.open_window(version)
            await self._consume(batch_id, version, out, started)
        # 3. The core closes the window; learn the prefix size.
        k = await asyncio.to_thread(self.membership.wait_frozen, batch_id, self.params.collective_timeout_s)
        out.prefix_size = k
        if self.index >= k:  # cannot happen: registration precedes the freeze
            raise FailedPrecondition(f"index {self.index} outside the frozen prefix {k}")
        # 4. Reduce (zeros when stale: a gradient on another version never enters).
        grad = self.trainer.flat_grads()
        if out.stale:
            grad.zero_()
        header, peak = self._header(stale=out.stale, device=grad.device)
        await self._collective(self.collective.reduce_to_core, k, grad)
        await self._collective(self.collective.reduce_to_core, k, header)
        await self._collective(functools.partial(self.collective.reduce_to_core, op="max"), k, peak)
        self.trainer.close_window()
        # 5. Receive the new weights.
        ver = torch.zeros(1, dtype=torch.float64, device=grad.device)
        await self._collective(self.collective.broadcast_from_core, k, ver)
        flat = torch.empty_like(self.trainer.flat_params())
        await self._collective(self.collective.broadcast_from_core, k, flat)
        out.new_version = int(ver.item())
        await asyncio.to_thread(self.trainer.load_flat_params, flat, out.new_version)
        await asyncio.to_thread(self.snapshots.publish, out.new_version, self.trainer.state_dict())
        out.seconds = self.clock() - started
        self.outcomes[batch_id] = out
        self._forget_old()
        log.info("batch done", extra=dataclasses.asdict(out))
        return out

    def _header(self, stale: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """What this cell reduces to the core beside its gradient: [tokens, stale, the
        diagnostics' sums] (SUM) and [the largest behaviour weight] (MAX). A stale satellite
        contributes nothing but its stale mark."""
        stats = LossStats() if stale else self.trainer.stats
        head = torch.tensor(
            [0.0 if stale else float(self.trainer.tokens), 1.0 if stale else 0.0], dtype=torch.float64
        )
        header = torch.cat([head, stats.sums_tensor()]).to(device)
        return header, torch.tensor([stats.weight_max], dtype=torch.float64, device=device)

    async def _consume(self, batch_id: int, version: int, out: BatchOutcome, started: float) -> None:
        """Claims and trains micro-steps until the packer says CLOSED: up to ``claim_batch``
        per ClaimMicroSteps call (the next call prefetched while this group computes), acked
        together in one AckMicroSteps call once the group is trained. A WAIT is a consistent
        pause point: no micro-step is half done."""
        keeper = asyncio.create_task(
            keep_claims(self.source, lambda: self._keep_every_s), name=f"keep.b{batch_id}"
        )
        pending: asyncio.Task[list[Claim]] | None = asyncio.create_task(self._claim(batch_id, version))
        try:
            while pending is not None:
                claims = await pending
                pending = None
                if self._broken is not None:  # a consistent point: nothing half done, no collective yet
                    raise Unavailable(f"batch {batch_id} abandoned: prefix groups {self._broken}")
                if claims[0].outcome is Outcome.CLOSED:
                    break
                if claims[0].outcome is Outcome.WAIT:
                    pending = asyncio.create_task(self._claim(batch_id, version))
                    continue
                steps = [c.micro_step for c in claims if c.micro_step is not None]
                ttl_s = min(c.ttl_s for c in claims)
                if ttl_s > 0:
                    self._keep_every_s = min(self.params.keep_claims_every_s, max(0.05, ttl_s / 3))
                for step in steps:
                    if step.batch_id not in (0, batch_id):
                        raise FailedPrecondition(
                            f"claimed micro-step of batch {step.batch_id} for {batch_id}"
                        )
                if self.params.prefetch:  # overlap the next claim with this group's compute
                    pending = asyncio.create_task(self._claim(batch_id, version))
                for step in steps:
                    n = await asyncio.to_thread(self.trainer.accumulate, step, version)
                    self.history.append("train", 0, b=batch_id, ms=step.micro_step_id, v=version)
                    if out.local_micro_steps == 0:
                        out.first_micro_step_s = self.clock() - started
                    out.local_tokens += n
                    out.local_micro_steps += 1
                ids = [step.micro_step_id for step in steps]
                await retrying(functools.partial(self.source.ack_many, batch_id, ids))
                for ms in ids:
                    claimed = self._claimed_at.pop(ms, 0.0)
                    self.history.append("ack", 0, b=batch_id, ms=ms, claimed=claimed)
                if pending is None:
                    pending = asyncio.create_task(self._claim(batch_id, version))
        finally:
            keeper.cancel()
            if pending is not None and not pending.done():
                pending.cancel()
            await asyncio.gather(keeper, *([pending] if pending else []), return_exceptions=True)
            # One batch consumes at a time: what is left was claimed by this attempt and never
            # acked (it failed, or a prefetched claim was abandoned); the packer hands it out again.
            self._claimed_at.clear()

    async def _claim(self, batch_id: int, version: int) -> list[Claim]:
        key = uuid.uuid4().hex  # one key for every retry of this claim
        claims = await retrying(
            lambda: self.source.claim_many(
                batch_id, version, self.params.claim_wait_s, self.params.claim_batch, key
            )
        )
        now = time.time()  # when they were handed out (the history's attempt)
        for c in claims:
            if c.micro_step is not None:
                self._claimed_at[c.micro_step.micro_step_id] = now
        return claims

    async def _commit(self, batch_id: int) -> None:
        try:
            await retrying(lambda: self.source.commit(batch_id))
            self.history.append("commit", 0, b=batch_id)
        except (FailedPrecondition, NotFound) as exc:
            # A packer that forgot the batch (a new WAL) or never leased it: nothing to redeliver.
            log.warning(
                "the packer did not commit the batch", extra={"batch_id": batch_id, "error": str(exc)}
            )


def _log_failure(task: asyncio.Task[BatchOutcome]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("batch failed", extra={"task": task.get_name(), "error": repr(task.exception())})
