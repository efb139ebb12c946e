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
