"""A prefix mirror whose watch cannot be ended still ends when cancelled.

aetcd's ``Watch.cancel`` (and its watch creation) wait for the client's shared watcher lock,
which a watch stream broken by a compaction or an etcd restart can hold for good. CI saw
tests/integration/test_etcd_control_plane.py::test_watch_relists_after_compaction hang for
its whole 300 s: ``wait_for`` cancelled the mirror's watch, and the watch's cancel in its
``finally`` never returned. Fakes stand in for aetcd here (the hang is a race in it)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gyre.etcd import watch as watch_mod
from gyre.etcd.watch import PrefixMirror


class _StuckWatch:
    """A watch that yields nothing and whose cancel never returns."""

    def __aiter__(self) -> _StuckWatch:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()

    async def cancel(self) -> None:
        await asyncio.Event().wait()


class _Client:
    def __init__(self, create_hangs: bool = False) -> None:
        self.create_hangs = create_hangs

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> _StuckWatch:
        if self.create_hangs:
            await asyncio.Event().wait()
        return _StuckWatch()


class _Etcd:
    def __init__(self, client: _Client) -> None:
        self.client = client


@pytest.fixture(autouse=True)
def _short_bound(monkeypatch):
    monkeypatch.setattr(watch_mod, "WATCH_CANCEL_TIMEOUT_S", 0.1, raising=False)


async def _ends(coro: Any) -> BaseException | None:
    """Runs ``coro`` for at most 5 s; its exception. Fails when it is still running."""
    task = asyncio.ensure_future(coro)
    await asyncio.wait({task}, timeout=5)
    assert task.done(), "still running: it would hang forever"
    return task.exception()


async def test_a_cancelled_watch_ends_though_its_cancel_hangs():
    mirror = PrefixMirror(_Etcd(_Client()), b"/r/", resync_s=30)  # type: ignore[arg-type]
    assert isinstance(await _ends(asyncio.wait_for(mirror._watch_until_resync(), 0.2)), TimeoutError)


async def test_a_watch_that_is_never_created_is_a_timeout_the_loop_relists_after():
    mirror = PrefixMirror(_Etcd(_Client(create_hangs=True)), b"/r/", resync_s=0.2)  # type: ignore[arg-type]
    assert isinstance(await _ends(mirror._watch_until_resync()), TimeoutError)


class _SwallowingWatch:
    """A watch that ends quietly when its reader is cancelled, as aetcd's can (its stream's
    termination awaits the request handler under ``except CancelledError: pass``)."""

    def __aiter__(self) -> _SwallowingWatch:
        return self

    async def __anext__(self) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise StopAsyncIteration from None

    async def cancel(self) -> None:
        return None


class _SwallowingClient:
    async def watch_prefix(self, prefix: bytes, start_revision: int) -> _SwallowingWatch:
        return _SwallowingWatch()


class _ListingEtcd:
    def __init__(self) -> None:
        self.client = _SwallowingClient()
        self.lists = 0

    async def get_prefix_paged(self, prefix: bytes, page: int) -> tuple[int, list[Any]]:
        self.lists += 1
        return 7, []


async def test_a_mirror_ends_when_cancelled_even_if_its_watch_swallows_the_cancellation():
    # CI, 12-04: test_watch_relists_after_compaction hung 300 s in ``gather`` of the cancelled
    # mirror task, its loop asleep on the 30 s resync timer: the run loop went on.
    etcd = _ListingEtcd()
    mirror = PrefixMirror(etcd, b"/r/", resync_s=30)  # type: ignore[arg-type]
    task = asyncio.ensure_future(mirror.run())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done(), "the mirror went on after its cancellation"
    assert task.cancelled()
    assert etcd.lists == 1
