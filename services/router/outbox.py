"""What a streamed model call hands its consumer (:class:`Outbox`): the chunks its attempts
took, then its end (the call completed, or the error it failed with).

The call puts one chunk per engine chunk; the consumer takes what queued up while it was
busy as one chunk, merged in place (never across policy versions). With ``coalesce_s`` it
first waits that long for more to join, before every chunk but the first (time to first
token pays no window) and only while the call goes on.
"""

from __future__ import annotations

import asyncio
import collections

from gyre.tokens import Chunk


class _End:
    """Sentinel: the stream ended normally (the last chunk carried the finish reason)."""


_END = _End()


class Outbox:
    """The buffer between a call's attempts (:meth:`put`, :meth:`end`, :meth:`fail`) and its
    consumer (:meth:`next`); all on the one event loop."""

    __slots__ = ("_buf", "_ready", "_first", "_end")

    def __init__(self) -> None:
        self._buf: collections.deque[Chunk | BaseException | _End] = collections.deque()
        self._ready = asyncio.Event()
        self._first = True
        self._end: BaseException | _End | None = None
        """The end the consumer reached (it comes after the chunks taken with it)."""

    def put(self, chunk: Chunk) -> None:
        self._push(chunk)

    def end(self) -> None:
        """The call completed (its last chunk carried the finish reason)."""
        self._push(_END)

    def fail(self, exc: BaseException) -> None:
        """The call failed with ``exc`` (the consumer gets it after the chunks before it)."""
        self._push(exc)

    def _push(self, item: Chunk | BaseException | _End) -> None:
        self._buf.append(item)
        self._ready.set()

    def raise_failure(self) -> None:
        """A call answered once, ended: raises the error it failed with, if it failed (its
        end is all that was put)."""
        outcome = self._buf.popleft()
        if isinstance(outcome, BaseException):
            raise outcome

    async def next(self, coalesce_s: float) -> Chunk | None:
        """The next chunk, what queued up merged; None once the call completed. Raises the
        error the call failed with."""
        if self._end is None:
            while not self._buf:
                self._ready.clear()
                await self._ready.wait()
            if coalesce_s > 0 and not self._first and _open_ended(self._buf[-1]):
                # Let more tokens join this message (never the first: time to first token
                # pays no window).
                await asyncio.sleep(coalesce_s)
            self._first = False
            merged: Chunk | None = None
            while self._buf:
                item = self._buf.popleft()
                if isinstance(item, Chunk):
                    if merged is None:
                        merged = item
                    elif item.policy_version != merged.policy_version:
                        self._buf.appendleft(item)  # never merge across policy versions
                        break
                    else:
                        # Emitted chunks are owned by this buffer alone: merge in place.
                        merged.token_ids.extend(item.token_ids)
                        merged.logprobs.extend(item.logprobs)
                        merged.text += item.text
                        merged.finish_reason = item.finish_reason
                else:
                    self._end = item
                    break
            if merged is not None:
                return merged
        if isinstance(self._end, BaseException):
            raise self._end
        return None


def _open_ended(item: Chunk | BaseException | _End) -> bool:
    """True for a chunk that more tokens may follow."""
    return isinstance(item, Chunk) and item.finish_reason is None
