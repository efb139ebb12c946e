"""The process's one etcd client: a thin layer over aetcd with deadlines, typed results and
compare-and-swap helpers.

Load only one etcd client per process (two register the same protobuf symbols). Per-call
deadlines come from ``timeout_s``; aetcd errors surface as :class:`gyre.errors.Unavailable`
(transport) or propagate (programming errors).

TLS: an endpoint ``https://host:port``, or a bare ``host:port`` when the process has TLS
files, is dialed with mutual TLS; etcd (``--client-cert-auth``) then takes the client
certificate's CN as the etcd user, so each process acts with its own user and role (see
:mod:`gyre.etcd.access`). ``http://host:port`` is plaintext. aetcd 1.x only dials
plaintext and authenticates with a password token that expires, so :class:`_TlsClient`
opens the secure channel itself; everything else is aetcd's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import aetcd
import aetcd.exceptions
import aetcd.watcher
import grpc

from gyre.errors import PermissionDenied, Unavailable

if TYPE_CHECKING:
    from gyre.grpcx.tls import TlsFiles

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KV:
    """One key's value and revisions."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_raw(cls, kv: Any) -> KV:
        return cls(
            key=kv.key,
            value=kv.value,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation inside a transaction: a put (value set) or a delete (value None); a
    delete with ``range_end`` removes every key in [key, range_end) (:func:`prefix_end`)."""

    key: bytes
    value: bytes | None = None
    lease: int | None = None
    range_end: bytes | None = None


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


@dataclasses.dataclass(frozen=True)
class Compare:
    """One guard of a transaction. ``target`` is "create", "mod", "version" or "value"."""

    key: bytes
    target: str
    op: str  # "==", "!=", "<", ">"
    value: Any


def create_revision_is(key: bytes, revision: int) -> Compare:
    """Guard: the key's create revision equals ``revision`` (0: the key does not exist)."""
    return Compare(key, "create", "==", revision)


def mod_revision_is(key: bytes, revision: int) -> Compare:
    """Guard: the key was last modified at ``revision`` (0: the key does not exist)."""
    return Compare(key, "mod", "==", revision)


_TRANSPORT_ERRORS = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    asyncio.TimeoutError,
)


CHANNEL_OPTIONS = {
    # gRPC's reconnect back-off grows to 120 s by default: after a long etcd outage the
    # channel would stay down long after etcd is back. Retry the connection every second
    # (the connect timeout itself stays at its default).
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}
"""Options of the etcd channel."""


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """aetcd's client over a mutual-TLS channel (no password token: the certificate's CN is
    the etcd user)."""

    def __init__(self, host: str, port: int, timeout: float, credentials: grpc.ChannelCredentials) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options=dict(CHANNEL_OPTIONS))
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = aetcd.rpc.secure_channel(
            target, self._credentials, options=list(self._options.items())
        )
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self.auth_stub = aetcd.rpc.AuthStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=None
        )
        self._connected.set()


def parse_endpoint(endpoint: str, has_tls: bool) -> tuple[str, int, bool]:
    """(host, port, tls) of ``[http://|https://]host:port``; a bare one uses TLS when the
    process has TLS files."""
    tls = has_tls
    for scheme, secure in (("https://", True), ("http://", False)):
        if endpoint.startswith(scheme):
            endpoint, tls = endpoint[len(scheme) :], secure
    host, _, port = endpoint.rstrip("/").rpartition(":")
    return host or "127.0.0.1", int(port), tls


class Etcd:
    """An etcd connection for one process (mutual TLS when ``tls`` has files)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 5.0, tls: TlsFiles | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self._endpoints = list(endpoints)
        self._timeout_s = timeout_s
        self._tls = tls if tls is not None and not tls.insecure else None
        self._client: aetcd.Client | None = None

    @property
    def timeout_s(self) -> float:
        """The deadline of each call."""
        return self._timeout_s

    @property
    def client(self) -> aetcd.Client:
        if self._client is None:
            raise RuntimeError("Etcd.connect() first")
        return self._client

    async def connect(self) -> None:
        """Connects to the first endpoint that answers a status call (once: a connected
        client stays connected, gRPC reconnects it)."""
        if self._client is not None:
            return
        last: Exception | None = None
        for endpoint in self._endpoints:
            host, port, secure = parse_endpoint(endpoint, self._tls is not None)
            client: aetcd.Client
            if secure:
                if self._tls is None:
                    raise ValueError(
                        f"etcd endpoint {endpoint} needs TLS but this process has no certificate"
                    )
                client = _TlsClient(host, port, self._timeout_s, self._tls.channel_credentials())
            else:
                client = aetcd.Client(
                    host=host, port=port, timeout=self._timeout_s, options=dict(CHANNEL_OPTIONS)
                )
            try:
                await client.connect()
                await asyncio.wait_for(client.status(), self._timeout_s)
            except Exception as exc:  # try the next endpoint
                last = exc
                await client.close()
                continue
            self._client = client
            return
        raise Unavailable(f"no etcd endpoint answered ({self._endpoints}): {last!r}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> Etcd:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # Reads -------------------------------------------------------------------------------

    async def get(self, key: bytes) -> KV | None:
        try:
            got = await self.client.get(key)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd get: {exc!r}") from exc
        except aetcd.exceptions.ClientError as exc:
            raise _refused("get", key, exc) from exc
        return None if got is None else KV.from_raw(got)

    async def get_prefix(self, prefix: bytes) -> tuple[int, list[KV]]:
        """All keys under ``prefix`` and the store revision they were read at."""
        try:
            got = await self.client.get_prefix(prefix)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd get_prefix: {exc!r}") from exc
        except aetcd.exceptions.ClientError as exc:
            raise _refused("get", prefix, exc) from exc
        return got.header.revision, [KV.from_raw(kv) for kv in got.kvs]

    async def get_prefix_paged(self, prefix: bytes, page: int = 1000) -> tuple[int, list[KV]]:
        """All keys under ``prefix``, read ``page`` keys per request at one revision (a
        consistent snapshot, as :meth:`get_prefix`), so no answer nears the gRPC message
        limit however many keys there are. Returns (the revision read at, the keys)."""
        if page < 1:
            raise ValueError("page must be >= 1")
        client = self.client
        end = prefix_end(prefix)
        start, revision, out = prefix, 0, []
        while True:
            request = aetcd.rpc.RangeRequest(
                key=start,
                range_end=end,
                limit=page,
                revision=revision,
                sort_order=aetcd.rpc.RangeRequest.ASCEND,
                sort_target=aetcd.rpc.RangeRequest.KEY,
            )
            try:
                got = await client.kvstub.Range(request, timeout=self._timeout_s, metadata=client.metadata)
            except _TRANSPORT_ERRORS as exc:
                raise Unavailable(f"etcd range: {exc!r}") from exc
            except aetcd.rpc.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise PermissionDenied(
                        f"etcd refused get {prefix.decode(errors='replace')}: {exc.details()}"
                    ) from exc
                raise Unavailable(f"etcd range: {exc.code().name} {exc.details()}") from exc
            revision = revision or got.header.revision
            out += [KV.from_raw(kv) for kv in got.kvs]
            if not got.more or not got.kvs:
                return revision, out
            start = got.kvs[-1].key + b"\0"

    async def count_prefix(self, prefix: bytes) -> int:
        try:
            got = await self.client.get_prefix(prefix, keys_only=True)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd count: {exc!r}") from exc
        return int(got.count)

    # Writes ------------------------------------------------------------------------------

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> int:
        """Unconditional put; returns the revision of the write."""
        try:
            got = await self.client.put(key, value, lease=lease)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd put: {exc!r}") from exc
        except aetcd.exceptions.ClientError as exc:
            raise _refused("put", key, exc) from exc
        return int(got.header.revision)

    async def delete(self, key: bytes) -> bool:
        try:
            got = await self.client.delete(key)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd delete: {exc!r}") from exc
        except aetcd.exceptions.ClientError as exc:
            raise _refused("delete", key, exc) from exc
        return bool(got)

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
    ) -> tuple[bool, int]:
        """One transaction; returns (succeeded, revision after it)."""
        client = self.client
        t = client.transactions
        built = []
        for c in compares:
            target = {"create": t.create, "mod": t.mod, "version": t.version, "value": t.value}[c.target](
                c.key
            )
            built.append(_apply_op(target, c.op, c.value))
        try:
            # aetcd returns only (succeeded, responses); read the header revision from the
            # raw response by calling the stub ourselves.
            request = aetcd.rpc.TxnRequest(
                compare=[b.build_message() for b in built],
                success=client._ops_to_requests([_to_aetcd(t, o) for o in success]),
                failure=client._ops_to_requests([_to_aetcd(t, o) for o in failure]),
            )
            resp = await client.kvstub.Txn(request, timeout=self._timeout_s, metadata=client.metadata)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd txn: {exc!r}") from exc
        except aetcd.rpc.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"etcd refused a transaction: {exc.details()}") from exc
            if "lease not found" in (exc.details() or ""):
                raise LeaseNotFound(f"etcd txn: {exc.details()}") from exc
            raise Unavailable(f"etcd txn: {exc.code().name} {exc.details()}") from exc
        return resp.succeeded, resp.header.revision

    async def cas(
        self, key: bytes, value: bytes, expected_mod_revision: int, lease: int | None = None
    ) -> tuple[bool, int]:
        """Writes ``value`` only if the key still has ``expected_mod_revision`` (0: absent)."""
        return await self.txn([mod_revision_is(key, expected_mod_revision)], [Op(key, value, lease)])

    async def create(self, key: bytes, value: bytes, lease: int | None = None) -> tuple[bool, int]:
        """Writes ``value`` only if the key does not exist."""
        return await self.txn([create_revision_is(key, 0)], [Op(key, value, lease)])

    # Leases ------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        try:
            lease = await self.client.lease(ttl_s)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd lease grant: {exc!r}") from exc
        return int(lease.id)

    async def refresh(self, lease_id: int) -> int:
        """Refreshes a lease; returns its remaining TTL (<= 0: the lease is gone)."""
        try:
            reply = await self.client.refresh_lease(lease_id)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd lease refresh: {exc!r}") from exc
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        """Revokes a lease; one that is already gone (expired) is not an error: its keys
        are gone too, which is what the caller wants."""
        try:
            await self.client.revoke_lease(lease_id)
        except _TRANSPORT_ERRORS as exc:
            raise Unavailable(f"etcd lease revoke: {exc!r}") from exc
        except aetcd.exceptions.ClientError as exc:
            if "lease not found" not in str(exc):
                raise

    async def compact(self, revision: int) -> None:
        await self.client.compact(revision, physical=True)


class LeaseNotFound(Unavailable):
    """A write named a lease etcd no longer has (it expired while this process could not
    refresh it): the lease keeper replaces it with a new session, whose hooks put the
    lease-bound keys again."""


def _refused(what: str, key: bytes, exc: Exception) -> Exception:
    """etcd's "permission denied" (a key outside this process's role) as PermissionDenied,
    "lease not found" as LeaseNotFound; any other client error unchanged."""
    if "permission denied" in str(exc):
        return PermissionDenied(f"etcd refused {what} {key.decode(errors='replace')}: {exc}")
    if "lease not found" in str(exc):
        return LeaseNotFound(f"etcd {what} {key.decode(errors='replace')}: {exc}")
    return exc


def _apply_op(target: Any, op: str, value: Any) -> Any:
    if op == "==":
        return target == value
    if op == "!=":
        return target != value
    if op == "<":
        return target < value
    if op == ">":
        return target > value
    raise ValueError(f"bad compare op {op!r}")


def _to_aetcd(t: Any, op: Op) -> Any:
    if op.value is None:
        return t.delete(op.key, range_end=op.range_end) if op.range_end is not None else t.delete(op.key)
    return t.put(op.key, op.value, lease=op.lease)
