"""A cost-model trainer for elastic cells (no model, no torch compute): claims the batch's
micro-steps from the packer like the real trainer and waits the simulator's training cost
(``sim.cost``: ``tokens * 6N / (gpus * FLOPS * MFU)`` per micro-step, then the fixed
optimizer cost on the core), time-scaled; the core then publishes ``keys.policy()`` exactly
like the real trainer (``services/cell_agent/training/store.py``).

Selected by ``cell_agent.training`` with ``mode: mock`` (see
``services/cell_agent/training/hook.py``); used by the emulated cluster (``sim/emulate.py``).

One batch on every participant:
  1. join: a satellite that does not hold the batch's version pays one weight sync;
  2. stream: claim micro-steps until the packer says CLOSED, each costing its tokens'
     training time (the final context length of every packed sequence, as in ``sim``);
  3. core only: wait until the packer says the batch is done (every micro-step acked),
     pay the fixed optimizer cost, expose snapshot ``v+1`` (one zero tensor, so that the
     mock engines' LoadPolicy pulls work unchanged) and publish version ``v+1`` in etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from gyre.grpcx.channel import dial, unary
from gyre.grpcx.tls import process_tls
from gyre.history import History
from gyre.identity import Role
from gyre.v1 import packer_pb2 as ppb
from gyre.v1 import packer_pb2_grpc as ppb_grpc
from services.cell_agent import snapshots
from services.cell_agent.training.config import MockTrainerSettings
from services.cell_agent.training.microstep import MicroStep, Outcome
from services.cell_agent.training.packer_client import PackerSource
from services.cell_agent.training.retry import keep_claims, retrying

log = logging.getLogger(__name__)


def sequence_tokens(step: MicroStep, marker: int = -1) -> int:
    """Tokens a micro-step costs. The packer packs one sequence per turn (its whole context
    plus its output); the simulator charges an episode its final context once. With a
    ``marker``, each sequence counts from its last marker on (the turn's new prompt segment
    plus its output), so the turns of an episode add up to its final context."""
    total = 0
    for s in step.sequences:
        ids = s.token_ids
        start = 0
        if marker >= 0:
            for i in range(len(ids) - 1, -1, -1):
                if ids[i] == marker:
                    start = i
                    break
        total += len(ids) - start
    return total


class MockTrainingHook:
    """The cell's training hook on the cost model (``services.cell_agent.hooks.TrainingHook``)."""

    def __init__(
        self,
        settings: MockTrainerSettings,
        *,
        cell_id: str,
        index: int,
        target: Callable[[], str] | str,
        etcd: Any = None,
        keys: Any = None,
        source: Any = None,
        batches: Any = None,
        publisher: Any = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        history: History | None = None,
    ) -> None:
        if index < 0:
            raise ValueError("only elastic cells (index >= 0) train")
        self.settings = settings
        self.history = history or History()
        self.cell_id = cell_id
        self.index = index
        self._target = target
        self.etcd = etcd
        self.keys = keys
        self.version = settings.initial_policy_version
        self.last_batch_id = 0
        self.store = snapshots.SnapshotStore(keep=2)
        self._source = source
        self._batches = batches  # async (batch_id) -> BatchStatus-like with .done
        self._publisher = publisher
        self._sleep = sleep
        self._clock = clock
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._current: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self.trained_tokens = 0
        self.micro_steps = 0

    @property
    def target(self) -> str:
        return self._target() if callable(self._target) else self._target

    # Wiring ---------------------------------------------------------------------------

    def _ensure_clients(self) -> None:
        s = self.settings
        if self._source is None:
            self._source = PackerSource(s.packer_target, self.cell_id)
        if self._batches is None:
            self._channel = dial(s.packer_target, process_tls(), Role.PACKER)
            stub = ppb_grpc.PackerStub(self._channel)

            async def get_batch(batch_id: int) -> ppb.BatchStatus:
                return await unary(stub.GetBatch, ppb.GetBatchRequest(batch_id=batch_id), timeout_s=10.0)

            self._batches = get_batch
        if self._publisher is None and self.index == 0 and self.etcd is not None and self.keys is not None:
            from services.cell_agent.training.store import EtcdPolicyPublisher

            self._publisher = EtcdPolicyPublisher(self.etcd, self.keys, self.target)

    def _expose(self, version: int) -> None:
        import torch

        if not self.store.versions() or version > self.store.newest:
            self.store.publish(version, {"w": torch.zeros(1)})

    def services(self) -> Sequence[tuple[Any, Any, str]]:
        if self.index == 0:
            self._expose(self.version)
        return [snapshots.registration(self.store)]

    # Lifecycle ------------------------------------------------------------------------

    async def on_enter_training(self) -> None:
        return None

    async def on_leave_training(self) -> None:
        task = self._current
        if task is not None and not task.done():
            with contextlib.suppress(Exception):  # its failure is logged by _log_failure
                await asyncio.shield(task)

    async def join_batch(self, cmd: Any) -> bool:
        batch_id, named = int(cmd.batch_id), int(cmd.policy_version)
        async with self._lock:
            if batch_id in self._tasks:
                return True
            prev = self._current
            if prev is not None and not prev.done():
                with contextlib.suppress(Exception):  # a timeout, or a failure _log_failure logged
                    await asyncio.wait_for(asyncio.shield(prev), self.settings.join_wait_s)
                if not prev.done():
                    return False
            if self.index == 0:
                if batch_id <= self.last_batch_id or named > self.version:
                    return False
                version = self.version
            else:
                version = named
            self._ensure_clients()
            task = asyncio.create_task(self._run(batch_id, version), name=f"mocktrain.b{batch_id}")
            task.add_done_callback(_log_failure)
            self._tasks[batch_id] = task
            self._current = task
            self.history.append("join", 0, b=batch_id, v=version, index=self.index)
            log.info("joined batch (mock trainer)", extra={"batch_id": batch_id, "version": version})
            return True

    async def wait_batch(self, batch_id: int) -> None:
        await asyncio.shield(self._tasks[batch_id])

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._source is not None and hasattr(self._source, "close"):
            await self._source.close()
        if self._channel is not None:
            await self._channel.close()

    # One batch ------------------------------------------------------------------------

    async def _run(self, batch_id: int, version: int) -> None:
        s = self.settings
        if self.index > 0 and self.version != version:
            await self._sleep(s.weight_sync_s * s.time_scale)
            self.version = version
        await self._consume(batch_id, version)
        if self.index != 0:
            return
        while not (await retrying(lambda: self._batches(batch_id))).done:
            await self._sleep(s.done_poll_s)
        await self._sleep(s.train_step_fixed_s * s.time_scale)
        new = version + 1
        self.version = new
        self.last_batch_id = batch_id
        self.history.append("step", 0, b=batch_id, v=version, new_v=new, applied=True)
        self._expose(new)
        if self._publisher is not None:
            await self._publisher.publish(new, batch_id)
            self.history.append("publish", 0, b=batch_id, v=new)
        log.info("batch stepped (mock trainer)", extra={"batch_id": batch_id, "version": new})

    async def _consume(self, batch_id: int, version: int) -> None:
        """Claims up to ``claim_batch`` micro-steps per call (one idempotency key for every
        retry of a call), trains them and acks them together, until the packer says CLOSED."""
        keeper = asyncio.create_task(keep_claims(self._source, lambda: 1.0))
        s = self.settings
        try:
            while True:
                key = uuid.uuid4().hex
                claims = await retrying(
                    functools.partial(
                        self._source.claim_many, batch_id, version, s.claim_wait_s, s.claim_batch, key
                    )
                )
                if claims[0].outcome is Outcome.CLOSED:
                    return
                steps = [c.micro_step for c in claims if c.micro_step is not None]
                if not steps:
                    continue
                claimed = time.time()
                for step in steps:
                    tokens = sequence_tokens(step, s.segment_marker_id)
                    await self._sleep(s.micro_step_s(tokens))
                    self.trained_tokens += tokens
                    self.micro_steps += 1
                    self.history.append("train", 0, b=batch_id, ms=step.micro_step_id, v=version)
                ids = [step.micro_step_id for step in steps]
                await retrying(functools.partial(self._source.ack_many, batch_id, ids))
                for ms in ids:
                    self.history.append("ack", 0, b=batch_id, ms=ms, claimed=claimed)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("mock batch failed", extra={"task": task.get_name(), "error": repr(task.exception())})
