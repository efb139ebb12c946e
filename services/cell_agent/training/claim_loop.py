"""The packer's side of one batch on this cell (:class:`ClaimLoop`): claims micro-steps a
few per call (the next call prefetched while the current group computes), trains them on the
batch's version, acks each group in one call, keeps the claims' leases alive meanwhile, and
records when each micro-step was handed out and acknowledged in the history. A WAIT is a
consistent pause point (no micro-step is half done), and so is the moment a broken prefix
group abandons the attempt, or a cell told to leave training before it trained anything
leaves it (:class:`BatchLeft`). The core commits the batch here once its step is durable.

Claims carry an idempotency key, so a retried claim never takes a second micro-step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from gyre.errors import FailedPrecondition, NotFound, Unavailable
from gyre.history import History
from services.cell_agent.training.microstep import Claim, Outcome
from services.cell_agent.training.outcomes import BatchOutcome
from services.cell_agent.training.params import ControllerParams
from services.cell_agent.training.ports import MicroStepSource
from services.cell_agent.training.retry import keep_claims, retrying
from services.cell_agent.training.trainer import Trainer

log = logging.getLogger(__name__)


class BatchLeft(Unavailable):
    """The cell left the batch at a WAIT before it trained any micro-step of it: it was
    told to leave training, and nothing of the attempt is lost or kept (the core opens the
    batch again when it is joined to it again)."""


class ClaimLoop:
    """Claims, trains and acks one batch's micro-steps; commits a batch (core)."""

    def __init__(
        self,
        *,
        source: MicroStepSource,
        trainer: Trainer,
        history: History,
        params: ControllerParams,
        clock: Callable[[], float],
        broken: Callable[[], str | None],
        leave: Callable[[int], Awaitable[str | None]] | None = None,
    ) -> None:
        self.source = source
        self.trainer = trainer
        self.history = history
        self.params = params
        self.clock = clock
        self.broken = broken
        """Why the prefix groups are unusable, or None (the controller's state)."""
        self.leave = leave
        """leave(batch_id): why this cell leaves the batch now, or None; asked at a WAIT
        before the cell trained anything of the batch (:class:`BatchLeft`)."""
        self._keep_every_s = params.keep_claims_every_s
        self.claimed_at: dict[str, float] = {}
        """When each claimed, not yet acked micro-step was handed out (the history's attempt)."""

    async def consume(self, batch_id: int, version: int, out: BatchOutcome, started: float) -> None:
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
                broken = self.broken()
                if broken is not None:  # a consistent point: nothing half done, no collective yet
                    raise Unavailable(f"batch {batch_id} abandoned: prefix groups {broken}")
                if claims[0].outcome is Outcome.CLOSED:
                    break
                if claims[0].outcome is Outcome.WAIT:
                    if out.local_micro_steps == 0 and self.leave is not None:
                        why = await self.leave(batch_id)
                        if why is not None:  # no claim outstanding, nothing trained
                            raise BatchLeft(f"batch {batch_id} left before its first micro-step: {why}")
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
                # The group is one round (a pipelined cell runs it as one 1F1B schedule).
                counts = await asyncio.to_thread(self.trainer.accumulate_round, steps, version)
                for step, n in zip(steps, counts, strict=True):
                    self.history.append("train", 0, b=batch_id, ms=step.micro_step_id, v=version)
                    if out.local_micro_steps == 0:
                        out.first_micro_step_s = self.clock() - started
                    out.local_tokens += n
                    out.local_micro_steps += 1
                ids = [step.micro_step_id for step in steps]
                await retrying(functools.partial(self.source.ack_many, batch_id, ids))
                for ms in ids:
                    claimed = self.claimed_at.pop(ms, 0.0)
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
            self.claimed_at.clear()

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
                self.claimed_at[c.micro_step.micro_step_id] = now
        return claims

    async def commit(self, batch_id: int) -> None:
        """Makes the batch's acks final at the packer (the core, once its step is durable)."""
        try:
            await retrying(lambda: self.source.commit(batch_id))
            self.history.append("commit", 0, b=batch_id)
        except (FailedPrecondition, NotFound) as exc:
            # A packer that forgot the batch (a new WAL) or never leased it: nothing to redeliver.
            log.warning(
                "the packer did not commit the batch", extra={"batch_id": batch_id, "error": str(exc)}
            )
