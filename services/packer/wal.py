"""The packer's write-ahead log: fsync'd, checksummed JSONL in a local directory, with
group commit.

Why a local WAL and not etcd: the packer's state is mostly token ids (tens of KiB per turn,
GiBs per burst), far past what etcd is built for (1.5 MiB requests, a few GiB database,
every write replicated through raft), and the packer is a single process per cluster whose
restart, not failover, is the recovery path. A local append-only log gives one fsync per
group of events, needs nothing outside the stdlib, and replays through the same
``PackerState.apply`` that made the state. Claims, acks and seals are in the same log, so a
restart neither loses a trajectory nor packs or hands out a micro-step twice. On a cluster
the directory is a persistent volume (a StatefulSet's PVC).

The log is compacted (:meth:`Wal.compact`) to a header and a snapshot of the state once it
has grown by ``wal_compact_bytes``, so neither the disk nor the replay grows without bound.

Each line is ``<crc32 hex> <json>``. A torn or checksum-failing *last* line (a crash in the
middle of a write) is cut off on open. A bad line followed by good ones is corruption (a
disk or a hand went wrong): the bad lines are moved to ``packer.wal.quarantine.<unix time>``
beside the log, with an error naming each, and every intact line is kept and replayed, so
one damaged record never keeps the packer (and every rollout feeding it) down. Events that
no longer apply without the lost ones are set aside at replay (``Packer.recover``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, overload

from gyre.backoff import Backoff
from gyre.errors import FatalError
from gyre.failpoints import failpoint

log = logging.getLogger(__name__)

Event = dict[str, Any]
WAL_NAME = "packer.wal"
DISK_FULL_RETRY_S = 1.0
"""How often a write blocked by a full disk is tried again, at most."""
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class EventLog(Protocol):
    """Where the controller writes events before it answers anyone."""

    def append(self, event: Event) -> None:
        """Queues one event (already applied in memory, in this order)."""

    async def sync(self) -> None:
        """Returns once every event appended so far is durable."""


class MemoryLog:
    """An EventLog kept in a list (unit tests, and to replay into a fresh state)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def append(self, event: Event) -> None:
        # Round-trip through JSON, as the real WAL would, so tests see what a replay sees.
        self.events.append(json.loads(json.dumps(event)))

    async def sync(self) -> None:
        return None


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""One encoder for every event (``json.dumps`` with these options builds one per call)."""


def encode_event(event: Event) -> str:
    """One event as its JSON object (the log's line without its checksum)."""
    return _JSON.encode(event)


def encode(event: Event) -> str:
    body = encode_event(event)
    return f"{zlib.crc32(body.encode()):08x} {body}\n"


class Wal:
    """An append-only event log in ``directory``; open() replays it."""

    def __init__(self, directory: str | os.PathLike[str], fsync: bool = True) -> None:
        self.path = Path(directory) / WAL_NAME
        self._fsync = fsync
        self._fd: int | None = None
        self._buf: list[str] = []
        self._appended = 0
        self._durable = 0
        self._flush_task: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._failed_event = asyncio.Event()
        self.bytes_written = 0
        self.bytes_since_compact = 0
        self.flushes = 0
        self.compactions = 0
        self.disk_full_pauses = 0
        """Times a write found the disk full and waited for space."""
        self.quarantined: list[int] = []  # line numbers moved aside by the last open()

    def open(self) -> WalEvents:
        """Reads every intact event, cuts a torn tail, and opens the log for appending. The
        events come back as :class:`WalEvents`, decoded as they are read."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        good_bytes = 0
        self.quarantined = []
        kept: list[bytes] = []
        if self.path.exists():
            data = self.path.read_bytes()
            lines = data.split(b"\n")
            # The piece after the last newline is empty, or a torn write.
            complete, tail = lines[:-1], lines[-1]
            bad: list[tuple[int, bytes]] = []
            for n, raw in enumerate(complete):
                event = _decode(raw)
                if event is None:
                    if n == len(complete) - 1 and not tail:
                        log.warning("packer WAL: dropping a torn last line", extra={"line": n + 1})
                        break
                    bad.append((n + 1, raw))
                    continue
                kept.append(raw)
                good_bytes += len(raw) + 1
            if tail:
                log.warning("packer WAL: dropping a torn tail", extra={"bytes": len(tail)})
            if bad:
                self._quarantine(bad, len(complete), b"".join(raw + b"\n" for raw in kept))
            elif good_bytes != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(good_bytes)
                    os.fsync(f.fileno())
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self._fsync:
            _fsync_dir(self.path.parent)
        self.bytes_since_compact = good_bytes  # a long log left behind is compacted soon
        return WalEvents(kept)

    def _quarantine(self, bad: list[tuple[int, bytes]], total: int, intact: bytes) -> None:
        """Moves corrupt lines aside (durably, first) and rewrites the log with the intact ones."""
        where = self.path.with_name(f"{WAL_NAME}.quarantine.{int(time.time() * 1000)}")
        with open(where, "wb") as f:
            for n, raw in bad:
                f.write(f"# line {n} of {total}\n".encode() + raw + b"\n")
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_name(WAL_NAME + ".intact")
        with open(tmp, "wb") as f:
            f.write(intact)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.quarantined = [n for n, _ in bad]
        log.error(
            "packer WAL: corrupt records quarantined; every intact record is recovered",
            extra={"lines": self.quarantined, "of": total, "quarantine": str(where)},
        )

    def archive(self) -> Path | None:
        """Moves the log aside (``packer.wal.<unix time>.old``) and starts an empty one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        moved = None
        if self.path.exists():
            moved = self.path.with_name(f"{WAL_NAME}.{int(time.time())}.old")
            os.replace(self.path, moved)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self._fsync:
            _fsync_dir(self.path.parent)
        return moved

    def append(self, event: Event) -> None:
        if self._failed is not None:
            raise FatalError(f"packer WAL failed: {self._failed!r}")
        self._buf.append(encode(event))
        self._appended += 1

    async def sync(self) -> None:
        target = self._appended
        while self._durable < target:
            if self._failed is not None:
                raise FatalError(f"packer WAL failed: {self._failed!r}")
            if self._flush_task is None:
                self._flush_task = asyncio.create_task(self._flush(), name="packer.wal.flush")
            # One waiter's cancellation must not cancel the flush the others wait on.
            await asyncio.shield(self._flush_task)

    async def compact(self, make_events: Callable[[], list[Event]]) -> int:
        """Rewrites the log as ``make_events()`` (a header and a snapshot of the state).

        ``make_events`` is called with no flush in flight, and its events must reflect every
        event appended so far: those still queued are dropped, as the snapshot holds their
        effect. The new log is written beside, fsync'd and renamed over the old one, so a
        crash leaves one or the other. Callers of :meth:`sync` wait for it like a flush.
        Returns the size of the new log in bytes."""
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)
        if self._failed is not None:
            raise FatalError(f"packer WAL failed: {self._failed!r}")
        size = 0

        async def _compact() -> None:
            nonlocal size
            queued: list[str] = []
            try:
                upto = self._appended
                events = make_events()  # a detached copy, taken atomically on the loop
                queued, self._buf = self._buf, []
                data = await asyncio.to_thread(lambda: "".join(encode(ev) for ev in events).encode())
                size = len(data)
                await asyncio.to_thread(self._rewrite, data)
                self._durable = max(self._durable, upto)
                self.bytes_since_compact = 0
                self.compactions += 1
            except asyncio.CancelledError:
                raise  # the loop is going away; not a write failure
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    self._fail(exc)
                    raise
                # No room for the new log beside the old one, which is intact: keep it (and
                # what was queued for it); the next check tries again.
                self._buf = queued + self._buf
                self.tmp_path().unlink(missing_ok=True)
                log.error("no space to compact the WAL; keeping the log", extra={"wal": str(self.path)})
                size = 0
            except BaseException as exc:
                self._fail(exc)
                raise
            finally:
                self._flush_task = None

        self._flush_task = asyncio.create_task(_compact(), name="packer.wal.compact")
        await asyncio.shield(self._flush_task)
        return size

    def _fail(self, exc: BaseException) -> None:
        """The log failed: every later append and sync raises (FatalError), and waiters wake."""
        self._failed = exc
        self._failed_event.set()

    def tmp_path(self) -> Path:
        """Where a compaction writes the new log before it replaces the old one."""
        return self.path.with_name(WAL_NAME + ".compact")

    def _rewrite(self, data: bytes) -> None:
        tmp = self.tmp_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                failpoint("packer.wal.compact")  # "=enospc": no room for the new log
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND, 0o644)
        if old is not None:
            os.close(old)

    async def _flush(self) -> None:
        try:
            lines, upto = self._buf, self._appended
            self._buf = []
            data = "".join(lines).encode()
            if data:
                await asyncio.to_thread(self._write, data)
            self._durable = upto
        except asyncio.CancelledError:
            raise  # the loop is going away; not a write failure
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._flush_task = None

    def _write(self, data: bytes) -> None:
        """Appends ``data`` (in the flush thread). A full disk pauses the log instead of
        failing it: the write is retried, from the byte where it stopped, until space
        returns, and the callers waiting on :meth:`sync` wait with it (a restart would only
        replay the same log onto the same full disk). Any other error, and any fsync error
        (the page cache's state is then unknown), fails the log."""
        assert self._fd is not None, "Wal.open() first"
        view = memoryview(data)
        full_since = 0.0
        backoff: Backoff | None = None  # made on a full disk only (its Random seeds from urandom)
        while view:
            try:
                failpoint("packer.wal.write")  # "=enospc": the disk under the WAL is full
                n = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                if not full_since:
                    full_since = time.monotonic()
                    self.disk_full_pauses += 1
                    log.error(
                        "the disk under the WAL is full; writes wait for space", extra={"wal": str(self.path)}
                    )
                backoff = backoff or Backoff(0.05, DISK_FULL_RETRY_S)
                time.sleep(backoff.next())
                continue
            view = view[n:]
        if full_since:
            log.warning(
                "space under the WAL again; writes go on", extra={"paused_s": time.monotonic() - full_since}
            )
        if self._fsync:
            os.fsync(self._fd)
        self.bytes_written += len(data)
        self.bytes_since_compact += len(data)
        self.flushes += 1

    async def watch(self) -> None:
        """A supervised task: ends the process (FatalError) when a write failed."""
        await self._failed_event.wait()
        raise FatalError(f"packer WAL write failed: {self._failed!r}")

    async def close(self) -> None:
        """Flushes what is queued and closes the file."""
        if self._failed is None:
            await self.sync()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WalEvents(Sequence[Event]):
    """The intact events of a log, each decoded when it is read: the log's lines are kept as
    bytes, the events not. Decoded, an event takes about eight times its line (its token ids
    become int objects); a packer that held a 117 MB log's 66,000 events while it replayed
    them peaked near 1 GB and kept ~700 MB resident after the replay (freed objects scattered
    among the kept ones). Each line is decoded twice at a restart, once by :meth:`Wal.open`
    to check it and once by the replay: CPU traded for memory, once per start. Read it once
    in order to replay it; equal to a list of the same events."""

    def __init__(self, lines: list[bytes]) -> None:
        self._lines = lines

    def __len__(self) -> int:
        return len(self._lines)

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: slice) -> list[Event]: ...
    def __getitem__(self, i: int | slice) -> Event | list[Event]:
        if isinstance(i, slice):
            return [_decoded(raw) for raw in self._lines[i]]
        return _decoded(self._lines[i])

    def __iter__(self) -> Iterator[Event]:
        for raw in self._lines:
            yield _decoded(raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-equal like a list


def read_durable(path: str | os.PathLike[str], chunk: int = 512) -> Generator[list[Event], None, None]:
    """The intact events of the log at ``path`` as it stands, ``chunk`` at a time, without
    opening it for appending: the log of a live packer, whose last line may be in the middle
    of its write (reading stops at the first line that does not check)."""
    with open(path, "rb") as f:
        out: list[Event] = []
        for raw in f:
            event = _decode(raw.rstrip(b"\n"))
            if event is None:
                break
            out.append(event)
            if len(out) >= chunk:
                yield out
                out = []
        if out:
            yield out


def _decoded(raw: bytes) -> Event:
    event = _decode(raw)
    assert event is not None, "a line WalEvents keeps was checked when the log was opened"
    return event


def _decode(raw: bytes) -> Event | None:
    crc, sep, body = raw.partition(b" ")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        event = json.loads(body)
    except ValueError:
        return None
    return event if isinstance(event, dict) and "t" in event else None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
