"""A retryable error carries its retry hint: UNAVAILABLE as trailing metadata
``retry-after-ms`` (and ``grpc-retry-pushback-ms``), kept next to metadata the servicer set
itself (the scheduler's ``x-gyre-leader``); a 503 from the router's HTTP API as
``Retry-After``; a client reads the hint back into the error."""

from __future__ import annotations

import grpc
import pytest

from gyre.errors import InvalidArgument, Unavailable, from_rpc_error, retry_after_for
from gyre.grpcx.errors import rpc
from services.router.http_responses import error_response as _error_response


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self._trailing: tuple[tuple[str, str], ...] = ()
        self.status: tuple[grpc.StatusCode, str] | None = None

    def set_trailing_metadata(self, md: tuple[tuple[str, str], ...]) -> None:
        self._trailing = tuple(md)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise _Aborted


class _Servicer:
    @rpc
    async def Call(self, request: object, context: _Context) -> None:
        context.set_trailing_metadata((("x-gyre-leader", "10.0.0.2:50051"),))
        raise request  # type: ignore[misc]


async def test_unavailable_carries_the_hint_and_keeps_other_metadata():
    ctx = _Context()
    with pytest.raises(_Aborted):
        await _Servicer().Call(Unavailable("etcd unreachable", retry_after_s=1.5), ctx)
    assert ctx.status == (grpc.StatusCode.UNAVAILABLE, "etcd unreachable")
    assert dict(ctx.trailing_metadata()) == {
        "x-gyre-leader": "10.0.0.2:50051",
        "retry-after-ms": "1500",
        "grpc-retry-pushback-ms": "1500",
    }


async def test_other_errors_carry_no_hint():
    ctx = _Context()
    with pytest.raises(_Aborted):
        await _Servicer().Call(InvalidArgument("bad"), ctx)
    assert "retry-after-ms" not in dict(ctx.trailing_metadata())
    assert retry_after_for(InvalidArgument("bad")) is None


def test_http_503_has_retry_after():
    resp = _error_response(Unavailable("no route", retry_after_s=0.2))
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert "Retry-After" not in _error_response(InvalidArgument("bad")).headers


class _RpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", "2500"),)


def test_the_client_reads_the_hint_back():
    err = from_rpc_error(_RpcError())
    assert isinstance(err, Unavailable) and err.retry_after_s == 2.5
