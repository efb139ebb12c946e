"""One event loop per process, supervised.

Every long-lived coroutine runs as a named task under :class:`Supervisor`, which waits with
FIRST_EXCEPTION and then shuts down in order: stop intake, drain with a grace period, cancel
the rest, flush, and re-raise the first failure (Temporal's ``Worker._run`` pattern). A
:class:`~gyre.errors.FatalError` (lease lost, engine dead) ends the process non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


class Supervisor:
    """Runs named tasks until one fails or a stop is requested."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._stop = asyncio.Event()
        self._on_stop_intake: list[Hook] = []
        self._on_drain: list[Hook] = []
        self._on_flush: list[Hook] = []

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        if name in self._tasks:
            raise ValueError(f"task {name!r} already running")
        task = asyncio.create_task(coro, name=f"{self.name}.{name}")
        self._tasks[name] = task
        return task

    def on_stop_intake(self, hook: Hook) -> None:
        self._on_stop_intake.append(hook)

    def on_drain(self, hook: Hook) -> None:
        self._on_drain.append(hook)

    def on_flush(self, hook: Hook) -> None:
        self._on_flush.append(hook)

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)

    async def run(self, grace_s: float = 5.0) -> None:
        """Waits for the first failure or a stop request, then shuts down in order."""
        stopper = asyncio.create_task(self._stop.wait(), name=f"{self.name}.stop")
        failure: BaseException | None = None
        try:
            # FIRST_EXCEPTION alone would never return on a stop request (the stopper ends
            # without an exception), so wait for the first completion until the stopper is
            # done or a task failed; a task that ends normally is only logged.
            pending: set[asyncio.Task[Any]] = {stopper, *self._tasks.values()}
            while failure is None and not stopper.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stopper and not task.cancelled() and task.exception() is not None:
                        failure = task.exception()
                        log.error("task failed", extra={"task": task.get_name(), "error": repr(failure)})
                        break
                    if task is not stopper and failure is None:
                        log.info("task ended", extra={"task": task.get_name()})
        finally:
            stopper.cancel()
            await self._shutdown(grace_s)
        if failure is not None:
            raise failure

    async def _shutdown(self, grace_s: float) -> None:
        for hook in self._on_stop_intake:
            await _quietly(hook())
        if self._on_drain:
            try:
                async with asyncio.timeout(grace_s):
                    for hook in self._on_drain:
                        await _quietly(hook())
            except TimeoutError:
                log.warning("drain grace period passed; cancelling")
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for hook in self._on_flush:
            await _quietly(hook())


async def _quietly(aw: Awaitable[None]) -> None:
    try:
        await aw
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("shutdown hook failed")
