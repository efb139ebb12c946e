"""Authorization by role: every RPC admits only the roles that need it.

Each servicer class carries one table, ``ACCESS``, next to its methods::

    class RouterServicer(router_pb2_grpc.RouterServicer):
        ACCESS = AccessTable("gyre.v1.Router", {
            "Generate": allow(Role.HARNESS),
            "MoveExecutions": allow(Role.SCHEDULER),
            ...
        })

:class:`~gyre.grpcx.server.GrpcServer` wraps every method handler of the service with a
guard built from its table before the server starts. A method without an entry refuses to
start the server (fail closed), and a table entry without a method is an error too. The
guard reads the caller's identity from its verified client certificate (``OU`` = role,
``CN`` = name, see :mod:`gyre.identity`); a caller of another role gets PERMISSION_DENIED
before the servicer runs, so nothing changes. ``allow(..., own="cell_id")`` further
requires the request's ``cell_id`` to be the caller's own name: a cell acts only for itself.
A bidirectional stream is checked once, when it opens, by role only (a rule with ``own``
cannot guard one); its servicer authorizes each message itself where it must.

grpc.aio server interceptors see only the method name and metadata, not the peer's
certificate, hence wrapping the handlers (whose ``context`` has ``auth_context()``).
Health checking and reflection are open to every authenticated caller: health for probes
and load balancers, reflection because the schema is public (it is in the repository) and
tools such as grpcurl need it; both still need a valid certificate.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from gyre.identity import Identity, Role

log = logging.getLogger(__name__)

EVERY_ROLE = frozenset(r for r in Role if r is not Role.ETCD)
"""Every role that calls Gyre RPCs (health checking and reflection)."""

_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("gyre_caller", default=None)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Who may call one RPC."""

    roles: frozenset[Role]
    own: str = ""
    """A request field that must equal the caller's identity name ("" = no such check)."""

    def describe(self) -> str:
        roles = ", ".join(sorted(r.value for r in self.roles))
        return f"{roles} (own {self.own} only)" if self.own else roles


def allow(*roles: Role, own: str = "") -> Rule:
    """The rule admitting ``roles`` (and, with ``own``, only for the caller's own id)."""
    if not roles:
        raise ValueError("allow() needs at least one role")
    return Rule(frozenset(roles), own)


@dataclasses.dataclass(frozen=True)
class AccessTable:
    """The rules of one gRPC service: method name -> :class:`Rule`."""

    service: str
    rules: Mapping[str, Rule]

    def methods(self) -> list[str]:
        """The service's methods according to its proto descriptor."""
        return service_methods(self.service)

    def check_complete(self) -> None:
        """Raises unless every method of the service has exactly one rule."""
        methods = set(self.methods())
        missing = sorted(methods - set(self.rules))
        unknown = sorted(set(self.rules) - methods)
        if missing or unknown:
            raise ValueError(
                f"access table of {self.service}: methods without a rule {missing}, rules without a method {unknown}"
            )


def service_methods(service: str) -> list[str]:
    """Method names of a service registered in the default descriptor pool (import its
    ``*_pb2`` module first)."""
    desc = descriptor_pool.Default().FindServiceByName(service)
    return [m.name for m in desc.methods]


def caller() -> Identity | None:
    """The verified identity of the caller of the RPC being served (None when the server
    runs with ``tls.insecure``)."""
    return _caller.get()


def not_own(who: Identity | None, field: str, request: Any) -> str | None:
    """Why ``request`` is refused by an ``own=field`` rule: its ``field`` is not the name of
    the caller ``who``; None when it is admitted (no such field, or no verified caller:
    ``tls.insecure``)."""
    if who is None or not field or getattr(request, field) == who.name:
        return None
    return f"{who} may act only for itself ({field}={who.name!r})"


_SPLIT = re.compile(r"(?<!\\),")
_identity_cache: dict[bytes, Identity | None] = {}


def identity_from_subject(subject: bytes) -> Identity | None:
    """Parses gRPC's ``x509_subject`` (RFC 4514, e.g. ``CN=cell-0,OU=cell-agent,O=gyre``)."""
    got = _identity_cache.get(subject)
    if got is not None or subject in _identity_cache:
        return got
    fields: dict[str, list[str]] = {}
    for part in _SPLIT.split(subject.decode(errors="replace")):
        key, sep, value = part.partition("=")
        if sep:
            fields.setdefault(key.strip().upper(), []).append(value.strip())
    identity: Identity | None = None
    ous, cns = fields.get("OU", []), fields.get("CN", [])
    if len(ous) == 1 and len(cns) == 1:
        try:
            identity = Identity(Role.parse(ous[0]), cns[0])
        except ValueError:
            identity = None
    if len(_identity_cache) < 4096:
        _identity_cache[subject] = identity
    return identity


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity the peer's verified certificate names, or None."""
    subject = context.auth_context().get("x509_subject")
    if not subject:
        return None
    return identity_from_subject(subject[0])


class Guard:
    """Checks callers of one service against its table; wraps its method handlers."""

    def __init__(self, table: AccessTable, enforce: bool = True) -> None:
        table.check_complete()
        self.table = table
        self.enforce = enforce

    async def _admit(
        self, method: str, rule: Rule, raw: Any, parse: Parse, context: grpc.aio.ServicerContext
    ) -> Any:
        """Checks the caller's role, parses the request, checks ``own``; sets the caller and
        returns the request. Aborts with PERMISSION_DENIED when the rule does not admit the
        caller, with INVALID_ARGUMENT when the message does not parse."""
        who: Identity | None = None
        if self.enforce:
            who = peer_identity(context)
            if who is None:
                await _deny(
                    context, f"{self.table.service}/{method}: the client certificate names no Gyre role"
                )
            assert who is not None
            if who.role not in rule.roles:
                await _deny(context, f"{self.table.service}/{method} admits {rule.describe()}, not {who}")
        request = await _parse(f"{self.table.service}/{method}", parse, raw, context)
        refusal = not_own(who, rule.own, request)
        if refusal is not None:
            await _deny(context, refusal)
        _caller.set(who)
        return request

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler behind the guard. It takes the raw bytes and parses them itself, so
        a message that does not parse (invalid UTF-8 in a string, nesting past protobuf's
        limit, garbage) is INVALID_ARGUMENT rather than grpc's INTERNAL."""
        rule = self.table.rules[method]
        parse = handler.request_deserializer
        if handler.request_streaming:
            if not handler.response_streaming or rule.own:
                raise ValueError(
                    f"{self.table.service}/{method}: only bidi streams without `own` are guarded"
                )
            return handler._replace(
                request_deserializer=None,
                stream_stream=self._bidi(method, rule, parse, handler.stream_stream),
            )
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=None,
                unary_stream=self._stream(method, rule, parse, handler.unary_stream),
            )
        return handler._replace(
            request_deserializer=None, unary_unary=self._unary(method, rule, parse, handler.unary_unary)
        )

    def _unary(
        self, method: str, rule: Rule, parse: Parse, behavior: Callable[..., Any]
    ) -> Callable[..., Any]:
        async def guarded(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await self._admit(method, rule, raw, parse, context)
            return await behavior(request, context)

        return guarded

    def _stream(
        self, method: str, rule: Rule, parse: Parse, behavior: Callable[..., Any]
    ) -> Callable[..., Any]:
        async def guarded(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await self._admit(method, rule, raw, parse, context)
            async for item in behavior(request, context):
                yield item

        return guarded

    def _bidi(
        self, method: str, rule: Rule, parse: Parse, behavior: Callable[..., Any]
    ) -> Callable[..., Any]:
        """A bidirectional stream: the caller's role is checked once, when the call opens;
        every message it sends is parsed (one that does not parse ends the call with
        INVALID_ARGUMENT)."""
        where = f"{self.table.service}/{method}"

        async def guarded(raws: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await self._admit(method, rule, None, None, context)

            async def requests() -> AsyncIterator[Any]:
                async for raw in raws:
                    yield await _parse(where, parse, raw, context)

            async for item in behavior(requests(), context):
                yield item

        return guarded


Parse = Callable[[bytes], Any] | None
"""A handler's request deserializer (None: the handler takes bytes)."""


async def _parse(where: str, parse: Parse, raw: Any, context: grpc.aio.ServicerContext) -> Any:
    if parse is None or not isinstance(raw, bytes | bytearray | memoryview):
        return raw
    try:
        return parse(bytes(raw))
    except Exception as exc:  # DecodeError, RecursionError, ...: the caller's bytes are bad
        log.warning("malformed request", extra={"method": where, "peer": context.peer(), "error": repr(exc)})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed request message ({exc})")


async def _deny(context: grpc.aio.ServicerContext, message: str) -> None:
    log.warning("permission denied", extra={"reason": message, "peer": context.peer()})
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` registers handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        for h in handlers:
            name = h.service_name()
            prefix = f"/{name}/"
            methods = {k[len(prefix) :]: v for k, v in h._method_handlers.items()}
            self.handlers.setdefault(name, {}).update(methods)

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers.setdefault(service, {}).update(handlers)


def register_guarded(
    server: grpc.aio.Server, servicer: Any, register: Callable[[Any, Any], None], enforce: bool = True
) -> str:
    """Registers ``servicer`` on ``server`` with every handler wrapped by the guard of the
    servicer's ``ACCESS`` table; returns the service name. Refuses a servicer without a
    table or one whose table does not cover exactly its methods."""
    table = getattr(servicer, "ACCESS", None)
    if not isinstance(table, AccessTable):
        raise TypeError(f"{type(servicer).__name__} has no ACCESS table: every RPC must say who may call it")
    capture = _Capture()
    register(servicer, capture)
    if set(capture.handlers) != {table.service}:
        raise ValueError(
            f"{type(servicer).__name__}: registers {sorted(capture.handlers)}, its table is for {table.service}"
        )
    guard = Guard(table, enforce)
    wrapped = {m: guard.wrap(m, h) for m, h in capture.handlers[table.service].items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(table.service, wrapped),))
    server.add_registered_method_handlers(table.service, wrapped)
    return table.service
