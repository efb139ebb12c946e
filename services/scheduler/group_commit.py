"""Group commit of the scheduler's guarded writes: launches and closes that arrive while a
transaction is in flight go out together in the next one.

Each write is a *unit*: its guards (``create_revision_is`` / ``mod_revision_is`` on its own
keys) and its operations. A group is one fenced transaction holding every unit's guards and
operations, so it keeps each unit's meaning: all of them apply at one revision, or none
does, and the leader fence still covers the whole. When the group's guards fail (one unit
lost its race), each unit is retried alone, so only the unit whose guard failed hears
:class:`~gyre.errors.Conflict`; a lost leadership (StaleEpoch) reaches every unit of the
group. Units touching the same key never share a transaction. etcd bounds a transaction's
operations (``--max-txn-ops``, 128 by default), so a group holds at most ``max_ops``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence

from gyre.etcd import Op
from gyre.etcd.client import Compare

FencedTxn = Callable[[Sequence[Compare], Sequence[Op]], Awaitable[tuple[bool, int]]]


@dataclasses.dataclass
class Unit:
    """One logical write: its guards, its operations, and who waits for the outcome."""

    compares: list[Compare]
    ops: list[Op]
    done: asyncio.Future[tuple[bool, int]]

    def keys(self) -> set[bytes]:
        return {c.key for c in self.compares} | {op.key for op in self.ops}


class GroupCommit:
    """Batches concurrent guarded writes into shared fenced transactions."""

    def __init__(self, txn: FencedTxn, max_ops: int = 120) -> None:
        self._txn = txn
        self._max_ops = max_ops
        self._queue: list[Unit] = []
        self._flusher: asyncio.Task[None] | None = None
        self.transactions = 0  # transactions sent (groups + retries alone)

    async def write(self, compares: Sequence[Compare], ops: Sequence[Op]) -> tuple[bool, int]:
        """Commits one unit; (its guards held, revision), as ``fenced_txn`` answers."""
        unit = Unit(list(compares), list(ops), asyncio.get_running_loop().create_future())
        self._queue.append(unit)
        if self._flusher is None or self._flusher.done():
            # A task of its own: a caller that is cancelled does not strand the others.
            self._flusher = asyncio.create_task(self._flush(), name="scheduler.group_commit")
        # Not shielded: a caller cancelled here cancels only its own future (the unit still
        # goes out with its group, and its outcome is dropped, as a shield would drop it).
        return await unit.done

    async def _flush(self) -> None:
        while self._queue:
            group = self._take()
            await self._commit(group)

    def _take(self) -> list[Unit]:
        """The longest prefix of the queue that fits one transaction with disjoint keys."""
        group: list[Unit] = []
        seen: set[bytes] = set()
        ops = 0
        for unit in self._queue:
            keys = unit.keys()
            if group and (ops + len(unit.ops) > self._max_ops or keys & seen):
                break
            group.append(unit)
            seen |= keys
            ops += len(unit.ops)
        del self._queue[: len(group)]
        return group

    async def _commit(self, group: list[Unit]) -> None:
        if len(group) > 1:
            try:
                ok, rev = await self._send(
                    [c for u in group for c in u.compares], [o for u in group for o in u.ops]
                )
            except BaseException as exc:  # StaleEpoch, Unavailable: the same for every unit
                for u in group:
                    _fail(u, exc)
                if not isinstance(exc, Exception):
                    raise
                return
            if ok:
                for u in group:
                    _settle(u, (True, rev))
                return
        for u in group:  # alone, or one of the group lost its race: each on its own
            try:
                _settle(u, await self._send(u.compares, u.ops))
            except BaseException as exc:
                _fail(u, exc)
                if not isinstance(exc, Exception):
                    raise

    async def _send(self, compares: list[Compare], ops: list[Op]) -> tuple[bool, int]:
        self.transactions += 1
        return await self._txn(compares, ops)


def _settle(unit: Unit, result: tuple[bool, int]) -> None:
    if not unit.done.done():
        unit.done.set_result(result)


def _fail(unit: Unit, exc: BaseException) -> None:
    if not unit.done.done():
        unit.done.set_exception(exc)
