"""The requests in flight on one bidirectional stream of tagged requests
(``Router.GenerateStream``, ``Engine.GenerateStream``): each request runs in a task of its
own, so a slow one does not hold up the others, and answers go out in the order they are
ready.

A service's session reads the caller's messages and starts each request with :meth:`start`
(checking :meth:`full` first: it answers a request beyond the limit itself); its request
coroutines :meth:`send` their answers. :meth:`serve` yields the answers ready since the
last yield, as a list, until the caller's request stream ended and no request is in flight;
a tag reused while its request is in flight ends the call with INVALID_ARGUMENT (the two
answers could not be told apart), as whatever the reading raises does. The call's end
cancels the requests still in flight. :meth:`close_when_idle` ends the call once nothing is
in flight even while the caller still sends (a stopping service: its session refuses new
requests itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from gyre.errors import InvalidArgument

A = TypeVar("A")


class TaggedRequests(Generic[A]):
    """One stream's requests in flight and the answers (of type ``A``) not yet sent."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._out: list[A] = []
        self._wake = asyncio.Event()
        self._reading = True
        self._closing = False

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def full(self) -> bool:
        return len(self._tasks) >= self.max_requests

    def check_tag(self, tag: int) -> None:
        """Raises InvalidArgument (which ends the call) when ``tag`` is in flight: a session
        checks it before anything else of a request."""
        if tag in self._tasks:
            raise InvalidArgument(f"tag {tag} is already in flight on this stream")

    def start(self, tag: int, request: Coroutine[Any, Any, None], name: str) -> None:
        """Runs ``request`` in a task of its own under ``tag`` (checked: :meth:`check_tag`)."""
        if tag in self._tasks:
            request.close()
            self.check_tag(tag)
        task = self._tasks[tag] = asyncio.create_task(request, name=name)
        task.add_done_callback(lambda done: self._ended(tag, done))

    def cancel(self, tag: int) -> None:
        """Ends request ``tag`` (a no-op when it is not in flight)."""
        task = self._tasks.pop(tag, None)
        if task is not None:
            task.cancel()

    def close_when_idle(self) -> None:
        """Ends :meth:`serve` once nothing is in flight, whether or not the caller's request
        stream ended."""
        self._closing = True
        self._wake.set()

    def send(self, answer: A) -> None:
        self._out.append(answer)
        if not self._wake.is_set():
            self._wake.set()

    async def serve(
        self, read: Callable[[], Awaitable[None]], one_turn: bool = False
    ) -> AsyncIterator[list[A]]:
        """Runs ``read`` (the session's loop over the caller's messages) and yields the
        answers ready, as lists, until it ended and nothing is in flight. ``one_turn``: once
        woken, wait one loop turn before yielding, so that every request woken by the same
        event (an engine step) joins the same list."""
        reader = asyncio.create_task(self._read(read), name="tagged-stream.read")
        try:
            while True:
                if not self._out:
                    if reader.done() and reader.exception() is not None:
                        raise reader.exception()  # type: ignore[misc]  # a reused tag, a malformed message
                    if (not self._reading or self._closing) and not self._tasks:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    if one_turn:
                        await asyncio.sleep(0)
                    continue
                out, self._out = self._out, []
                yield out
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, read: Callable[[], Awaitable[None]]) -> None:
        try:
            await read()
        finally:
            self._reading = False
            self._wake.set()

    def _ended(self, tag: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(tag) is task:
            del self._tasks[tag]
            self._wake.set()  # the stream may end now
