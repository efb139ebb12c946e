"""Talking to the packer through its outages: retries with back-off, and the claim
keep-alive, shared by the real trainer's controller and the cost-model trainer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from gyre.backoff import Backoff
from gyre.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Keeper(Protocol):
    async def keep(self) -> None: ...


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    """Calls the packer until it answers: UNAVAILABLE and DEADLINE_EXCEEDED are retried
    with exponential back-off (up to 2 s); any other error is the caller's."""
    backoff = Backoff(0.05, 2.0)
    while True:
        try:
            return await call()
        except (Unavailable, DeadlineExceeded) as exc:
            log.warning("packer unavailable; retrying", extra={"error": repr(exc)})
            await backoff.sleep()


async def keep_claims(source: _Keeper, every_s: Callable[[], float]) -> None:
    """Keeps the cell's claims alive until cancelled (``every_s()`` is read each round, so
    the period can follow the claims' TTL); a missed keep is retried next round."""
    while True:
        await asyncio.sleep(every_s())
        with contextlib.suppress(Unavailable, DeadlineExceeded):
            await source.keep()
