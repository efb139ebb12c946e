"""The harness replay driver of the emulated cluster: plays a ``sim.workload.Trace`` through
the real scheduler and router, time-scaled, from one asyncio process.

Each worker acquires an execution (``HarnessClient``), maps the scheduler's task id
``task-<i>`` to trace task ``i`` and the order of acquisition within its group to the member
index (so a group plays the same episodes as in the simulator), then plays the episode: the
sandbox start as a sleep, per turn one ``Router.Generate`` (the whole context so far as
prompt token ids, ``max_tokens`` = the turn's output tokens), the tool wait as a sleep, the
reward computation as a sleep, and ``FinishExecution``. Every sleep is divided by the time
scale. Each turn's new prompt segment opens with a marker token (``MARKER``) that the
cost-model trainer uses to charge an episode its final context once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import grpc

from gyre.client.harness import HarnessClient
from gyre.errors import GyreError
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles
from gyre.identity import Role
from gyre.v1 import common_pb2, router_pb2, router_pb2_grpc
from sim.workload import Episode, Trace

log = logging.getLogger(__name__)

MARKER = 2
"""Opens each turn's new prompt segment (mock engines emit ids >= 3)."""

_TASK_RE = re.compile(r"(\d+)$")


def task_index(task_id: str) -> int:
    """Trace task index of the scheduler's built-in task ``task-<i>``."""
    m = _TASK_RE.search(task_id)
    if m is None:
        raise ValueError(f"task id {task_id!r} has no index")
    return int(m.group(1))


def segment(n: int, salt: int) -> list[int]:
    """``n`` prompt tokens of a new segment: the marker, then deterministic ids >= 3."""
    if n <= 0:
        return []
    return [MARKER] + [3 + (salt * 31 + i * 7) % 400 for i in range(n - 1)]


@dataclasses.dataclass
class ReplayStats:
    """What the driver did."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    """Executions the scheduler cancelled under the driver (the cancel-early rule: their
    group could no longer be trained within the staleness bound). By design, not a loss."""
    turns: int = 0
    generated_tokens: int = 0
    reroutes: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class ReplayDriver:
    """Plays a trace through the real services until ``stop`` is set."""

    def __init__(
        self,
        *,
        trace: Trace,
        scheduler_target: str,
        router_target: str,
        time_scale: float,
        workers: int,
        max_context: int = 1 << 17,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        tls_dir: str | None = None,
        insecure: bool = False,
        answer_once: bool = True,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.trace = trace
        self.scheduler_target = scheduler_target
        self.router_target = router_target
        self.time_scale = time_scale
        self.workers = workers
        self.max_context = max_context
        self.tls_dir = tls_dir  # the harness identity it presents (mTLS)
        self.insecure = insecure
        self.answer_once = answer_once  # Router.Generate's one-message answer (False: streamed)
        self._sleep = sleep
        self.stats = ReplayStats()
        self._members: dict[str, int] = defaultdict(int)
        self._channel: grpc.aio.Channel | None = None
        self._router: router_pb2_grpc.RouterStub | None = None

    def episode_for(self, task_id: str, group_id: str, policy_version: int) -> Episode:
        """The trace episode of this execution (deterministic per task, member order)."""
        member = self._members[group_id]
        self._members[group_id] += 1
        return self.trace.episode(task_index(task_id), member, policy_version)

    async def run(self, stop: asyncio.Event) -> ReplayStats:
        tls = TlsFiles(insecure=True) if self.insecure else TlsFiles.from_dir(self.tls_dir or "")
        self._channel = dial(self.router_target, tls, Role.ROUTER)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        try:
            async with HarnessClient(
                self.scheduler_target, harness_id="emulate", tls_dir=self.tls_dir, insecure=self.insecure
            ) as client:
                tasks = [asyncio.create_task(self._worker(client, stop)) for _ in range(self.workers)]
                await stop.wait()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._channel.close()
        return self.stats

    async def _worker(self, client: HarnessClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                handle = await client.acquire(wait_s=2.0)
            except GyreError as exc:
                self._error(f"acquire: {exc}")
                await asyncio.sleep(0.5)
                continue
            if handle is None:
                await asyncio.sleep(min(max(client.last_retry_after_s, 0.05), 1.0))
                continue
            ep = self.episode_for(handle.task_id, handle.group_id, handle.policy_version)
            self.stats.started += 1
            async with handle:
                error = await self._play(handle.execution_id, handle.token, ep)
                try:
                    await handle.finish(
                        reward=float(ep.member % 2) + 0.01 * ep.task,
                        status="failed" if error else "completed",
                    )
                except GyreError as exc:
                    self._error(f"finish: {exc}")
                    continue
                if handle.cancelled_by_scheduler:
                    # A model call refused because its execution was cancelled is the cancel
                    # rule working, not a failure of the run.
                    self.stats.cancelled += 1
                    log.info("replay: %s cancelled by the scheduler", handle.execution_id)
                elif error:
                    self.stats.failed += 1
                    self._error(error)
                else:
                    self.stats.finished += 1

    async def _play(self, execution_id: str, token: str, ep: Episode) -> str:
        """Plays one episode; returns "" when every turn completed, else what failed."""
        scale = 1.0 / self.time_scale
        await self._sleep(ep.sandbox_s * scale)
        context: list[int] = []
        metadata = (("authorization", f"Bearer {token}"),)
        for k in range(ep.turns):
            context += segment(ep.prompt_tokens[k], ep.task * 1000 + ep.member * 100 + k)
            if len(context) > self.max_context:
                context = context[-self.max_context :]
            req = router_pb2.GenerateRequest(
                execution_id=execution_id,
                prompt_token_ids=context,
                sampling=common_pb2.SamplingParams(
                    max_tokens=ep.output_tokens[k], temperature=1.0, seed=ep.task * 7919 + ep.member * 31 + k
                ),
                answer_once=self.answer_once,  # an agent harness waits for the whole answer
            )
            out: list[int] = []
            moved = 0
            try:
                assert self._router is not None
                async for resp in self._router.Generate(req, metadata=metadata, timeout=3600.0):
                    out.extend(resp.chunk.token_ids)
                    moved = max(moved, resp.reroutes)
            except grpc.aio.AioRpcError as err:
                return f"generate {execution_id} turn {k}: {err.code().name} {err.details()}"
            self.stats.turns += 1
            self.stats.reroutes += moved
            self.stats.generated_tokens += len(out)
            context += out
            if ep.tool_s[k] > 0:
                await self._sleep(ep.tool_s[k] * scale)
        await self._sleep(ep.reward_s * scale)
        return ""

    def _error(self, msg: str) -> None:
        log.warning("replay: %s", msg)
        if len(self.stats.errors) < 20:
            self.stats.errors.append(msg)


async def watch_updates(
    get_version: Callable[[], object],
    n: int,
    stop: asyncio.Event,
    t0: float,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
) -> list[float]:
    """Polls the published policy version until it reaches ``n``; returns the wall seconds
    (since ``t0``) at which each version 1..n was first seen, then sets ``stop``."""
    times: list[float] = []
    seen = 0
    try:
        while seen < n:
            v = await get_version()  # type: ignore[misc]
            while seen < min(int(v), n):
                seen += 1
                times.append(clock() - t0)
            if seen < n:
                await asyncio.sleep(poll_s)
    finally:
        stop.set()
    return times
