"""Domain errors, and the one place that maps them to gRPC status codes and HTTP statuses.

Domain code raises these; servicers and HTTP handlers never build status codes by hand.
Per-request errors are recoverable. A :class:`FatalError` means the process can no longer
keep its promises (engine dead, lease lost): it is fanned out to waiters and the process
exits non-zero so its lease lapses and a supervisor restarts it.
"""

from __future__ import annotations

import grpc


class GyreError(Exception):
    """Base of every per-request error. ``code`` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500


class InvalidArgument(GyreError):
    """Malformed or out-of-range input; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(GyreError):
    """An unknown id."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Unauthenticated(GyreError):
    """No token, or a token that names no execution."""

    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDenied(GyreError):
    """A valid token used on an execution it does not hold."""

    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class FailedPrecondition(GyreError):
    """The request is well-formed but illegal in the current state."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class StaleEpoch(FailedPrecondition):
    """A command or write carried a fencing epoch older than the newest seen."""


class Conflict(GyreError):
    """A compare-and-swap lost a race; the caller may re-read and retry."""

    code = grpc.StatusCode.ABORTED
    http_status = 409


class ResourceExhausted(GyreError):
    """Too large, or no capacity left."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class RateLimited(ResourceExhausted):
    """Over a rate limit; retry after a while (HTTP 429)."""

    http_status = 429


class Unavailable(GyreError):
    """A dependency is down or no destination can take the work; retry later.

    ``retry_after_s`` is the hint sent with it: gRPC trailing metadata ``retry-after-ms``
    (and ``grpc-retry-pushback-ms``, which gRPC's own retry policy honours), HTTP
    ``Retry-After``."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503

    def __init__(self, *args: object, retry_after_s: float = 1.0) -> None:
        super().__init__(*args)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(GyreError):
    """The caller's deadline passed before the work finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Internal(GyreError):
    """A component broke its contract (e.g. an engine answered tokens without a behaviour
    log-prob each): the request failed and nothing was made of its answer. A router takes it
    from an engine as a failed attempt (retried within its budget, elsewhere if it can)."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class FatalError(Exception):
    """The process must stop (engine dead, lease lost, etcd gone past its budget)."""


_FROM_GRPC: dict[grpc.StatusCode, type[GyreError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Unauthenticated,
        PermissionDenied,
        FailedPrecondition,
        Conflict,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


_FROM_HTTP: dict[int, type[GyreError]] = {
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: FailedPrecondition,
    413: ResourceExhausted,
    429: RateLimited,
    503: Unavailable,
    504: DeadlineExceeded,
}


def from_http_status(status: int, message: str) -> GyreError:
    """The domain error for an HTTP error status (any other 4xx is InvalidArgument)."""
    cls = _FROM_HTTP.get(status) or (InvalidArgument if 400 <= status < 500 else GyreError)
    return cls(f"HTTP {status}: {message}")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an exception raised while serving a call."""
    if isinstance(exc, GyreError):
        return exc.code, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


RETRY_AFTER_MS = "retry-after-ms"
"""Trailing metadata key of the retry hint (milliseconds)."""


def retry_after_for(exc: BaseException) -> float | None:
    """Seconds the caller should wait before retrying, or None when no retry is advised."""
    if isinstance(exc, Unavailable):
        return exc.retry_after_s
    return None


def http_status_for(exc: BaseException) -> int:
    """The HTTP status for an exception raised while serving an HTTP request."""
    return exc.http_status if isinstance(exc, GyreError) else 500


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError) -> GyreError:
    """Turns a failed call's status back into the matching domain error."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    cls = _FROM_GRPC.get(code, GyreError)
    details = err.details() if hasattr(err, "details") else str(err)
    out = cls(details or code.name)
    if cls is GyreError:
        out.code = code
    if isinstance(out, Unavailable):
        hint = _metadata_ms(err, RETRY_AFTER_MS)
        if hint is not None:
            out.retry_after_s = hint
    return out


def from_status(code: int, message: str) -> GyreError:
    """The domain error for a status carried inside a message (a multiplexed stream's
    per-request end) rather than as a call's status: ``code`` is a gRPC status number."""
    status = _STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _FROM_GRPC.get(status, GyreError)
    out = cls(message or status.name)
    if cls is GyreError:
        out.code = status
    return out


_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {s.value[0]: s for s in grpc.StatusCode}


def _metadata_ms(err: grpc.aio.AioRpcError | grpc.RpcError, key: str) -> float | None:
    """A millisecond value of the call's trailing metadata, in seconds (None if absent)."""
    trailing = getattr(err, "trailing_metadata", None)
    items = trailing() if callable(trailing) else None
    for k, value in items or ():
        if k == key:
            try:
                return max(0.0, int(value) / 1000.0)
            except (TypeError, ValueError):
                return None
    return None
