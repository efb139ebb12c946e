"""Servicer-side error mapping: domain errors become precise statuses in one place.

Wrap every servicer method with :func:`rpc` (unary) or :func:`rpc_stream` (server
streaming). A :class:`~gyre.errors.GyreError` aborts the call with its status and changes
nothing further; any other exception is logged and becomes INTERNAL. Cancellation is never
swallowed. An UNAVAILABLE carries its retry hint as trailing metadata (``retry-after-ms``,
and ``grpc-retry-pushback-ms`` for gRPC's own retry policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from gyre.errors import RETRY_AFTER_MS, GyreError, Unauthenticated, retry_after_for, status_for

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def rpc(fn: F) -> F:
    """Decorates a unary servicer method."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _statuses(context, fn):
            return await fn(self, request, context)

    return wrapper  # type: ignore[return-value]


def rpc_stream(fn: F) -> F:
    """Decorates a server-streaming servicer method (an async generator)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _statuses(context, fn):
            async for item in fn(self, request, context):
                yield item

    return wrapper  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def _statuses(context: grpc.aio.ServicerContext, fn: Callable[..., Any]) -> AsyncIterator[None]:
    """What the body raises becomes the call's status: a domain error its own, anything
    else INTERNAL; cancellation passes through."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except GyreError as exc:
        await _abort(context, exc)
    except Exception as exc:
        await _unexpected(context, exc, fn)


async def _abort(context: grpc.aio.ServicerContext, exc: GyreError) -> None:
    """Ends the call with the error's status and, for a retryable one, its retry hint."""
    code, msg = status_for(exc)
    hint = retry_after_for(exc)
    if hint is not None:
        ms = str(max(0, round(hint * 1000)))
        kept = tuple(context.trailing_metadata() or ())  # e.g. a standby's x-gyre-leader
        context.set_trailing_metadata((*kept, (RETRY_AFTER_MS, ms), ("grpc-retry-pushback-ms", ms)))
    await context.abort(code, msg)


async def _unexpected(context: grpc.aio.ServicerContext, exc: Exception, fn: Callable[..., Any]) -> None:
    """The one place that turns the unexpected into INTERNAL (logged with its traceback);
    an abort already under way passes through."""
    if _is_abort(exc):
        raise exc
    log.exception("unhandled error in %s", fn.__qualname__)
    code, msg = status_for(exc)
    await context.abort(code, msg)


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises an internal exception that must propagate untouched.
    return type(exc).__name__ == "AbortError" or isinstance(exc, grpc.RpcError)


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    """The first value of metadata ``key`` (lower case), or None."""
    for k, value in context.invocation_metadata() or ():
        if k == key:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def bearer_token(context: grpc.aio.ServicerContext) -> str:
    """The execution token from ``authorization: Bearer <token>``; UNAUTHENTICATED if absent."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.startswith("Bearer "):
            token = str(value)[len("Bearer ") :].strip()
            if token:
                return token
    raise Unauthenticated("missing execution token (authorization: Bearer <token>)")
