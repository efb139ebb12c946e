"""``heap_profile_s``: a service logs what its Python heap grew by since the first interval,
by allocation site, so a soak can name what grows."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc

import pytest

from gyre import heap
from gyre.config import ServiceConfig

KEPT: list[bytes] = []


def _grow() -> None:
    KEPT.extend(bytes(1024) + bytes([i % 256]) for i in range(2000))  # ~2 MiB kept here


async def test_the_growth_is_logged_at_the_site_that_allocated(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gyre.heap")
    task = asyncio.create_task(heap.log_growth(0.2, top=5))
    try:
        await asyncio.sleep(0.3)  # after the baseline
        _grow()
        for _ in range(50):
            await asyncio.sleep(0.1)
            if any(r.message == "heap growth" for r in caplog.records):
                break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        tracemalloc.stop()
        KEPT.clear()
    record = next(r for r in caplog.records if r.message == "heap growth")
    top = record.top  # type: ignore[attr-defined]
    assert top and top[0]["kib"] > 1500 and top[0]["objects"] >= 2000
    assert any("test_heap_profile.py" in site for site in top[0]["at"])


def test_the_profile_is_off_unless_configured() -> None:
    assert ServiceConfig.model_fields["heap_profile_s"].default == 0


async def test_the_heap_is_trimmed_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """``heap_trim_s`` (on by default): every interval the free arena pages go back."""
    calls: list[float] = []
    monkeypatch.setattr(heap, "release_free_heap", lambda: calls.append(1.0) or True)
    task = asyncio.create_task(heap.trim_every(0.05))
    try:
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(calls) >= 3:
                break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(calls) >= 3
    assert ServiceConfig.model_fields["heap_trim_s"].default > 0


def test_services_start_with_two_malloc_arenas_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's processes get MALLOC_ARENA_MAX=2 (glibc's default is 8 per core), and
    an operator's own setting wins."""
    import subprocess

    from apps import procs

    seen: list[dict[str, str]] = []

    def fake_spawn(cmd: list[str], **kw: object) -> subprocess.Popen[str]:
        seen.append(dict(kw["env"]))  # type: ignore[call-overload]
        raise OSError("not started")

    monkeypatch.setattr(procs, "spawn", fake_spawn)
    monkeypatch.setattr(procs, "ensure_process_identity", lambda *a: None)
    for inherited in (None, "4"):
        if inherited is None:
            monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
        else:
            monkeypatch.setenv("MALLOC_ARENA_MAX", inherited)
        with pytest.raises(OSError):
            procs.ServiceProcess("router", None).start(timeout_s=1)
    assert [e["MALLOC_ARENA_MAX"] for e in seen] == ["2", "4"]
