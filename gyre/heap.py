"""Handing the heap a process freed back to the operating system.

glibc's malloc keeps freed memory in its arenas (one per thread that allocates: asyncio's
worker threads, gloo's and gRPC's) and returns to the system only the free top of a heap,
above a threshold that grows with the largest block freed. A process that allocates and
frees many large blocks of varying sizes, again and again, keeps that memory resident: a
trainer does (each micro-step's activations and gradients, the flat gradient and weight
buffers, the checkpoint it serializes, the snapshot it copies). In a soak the core cell
agent's RSS crept up by about 10 MB a minute; driven alone for 400 batches (gloo with a
satellite, snapshot pulls over TLS), the core's training path went from 592 to 721 MB of
RSS while its live heap stayed near 495 MB: one ``malloc_trim(0)`` brought it to 498 MB.

:func:`release_free_heap` returns every free page of every arena (glibc's
``malloc_trim(0)``); where there is no glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        log.debug("no malloc_trim in this C library: freed heap stays with the allocator")
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Returns the free pages of every malloc arena to the system; True when some were
    released, False when none were or the C library cannot (not glibc). Blocking (it walks
    every arena: about 20 ms for the core's 500 MB heap on a loaded 2-core machine): run it
    off the event loop."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


async def trim_every(every_s: float) -> None:
    """Every ``every_s`` seconds, hands the free pages of every malloc arena back to the
    system (:func:`release_free_heap`, in a thread): a supervised task of every service
    (config ``heap_trim_s``). The Python heap of the scheduler, the packer and the cell agents
    held flat over a 20-minute run while their RSS grew a few MB an hour: what gRPC's and
    torch's C code freed stayed with glibc's arenas."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(release_free_heap)


async def log_growth(every_s: float, top: int = 12, frames: int = 8) -> None:
    """Every ``every_s`` seconds, logs the Python heap's growth since the first interval by
    allocation site (tracemalloc, ``frames`` deep): the ``top`` sites that grew most, each
    with its KiB and objects added and its innermost frames. A supervised task (config
    ``heap_profile_s``); what C libraries allocate outside Python's allocator is not seen."""
    import tracemalloc

    tracemalloc.start(frames)
    ignore = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
    await asyncio.sleep(every_s)
    # In a thread: a cell agent's snapshot (~100 MB of traced heap) takes seconds, which the
    # event loop (the lease keeper among its tasks) must not wait out in one piece.
    base = (await asyncio.to_thread(tracemalloc.take_snapshot)).filter_traces(ignore)
    while True:
        await asyncio.sleep(every_s)
        snap = (await asyncio.to_thread(tracemalloc.take_snapshot)).filter_traces(ignore)
        diff = await asyncio.to_thread(snap.compare_to, base, "traceback")
        grown = [d for d in diff if d.size_diff > 0][:top]
        traced, peak = tracemalloc.get_traced_memory()
        log.info(
            "heap growth",
            extra={
                "traced_mb": round(traced / 2**20, 1),
                "peak_mb": round(peak / 2**20, 1),
                "top": [
                    {
                        "kib": round(d.size_diff / 1024, 1),
                        "objects": d.count_diff,
                        "at": [f"{f.filename.rsplit('/', 3)[-1]}:{f.lineno}" for f in d.traceback][-frames:],
                    }
                    for d in grown
                ],
            },
        )
