"""Immutable weight snapshots: the store the core publishes into, the WeightSnapshots
servicer that streams a version in chunks, and the client that pulls one back.

A snapshot is a frozen CPU copy of a state dict at one policy version. The core publishes
version ``v`` before it trains on it and ``v+1`` after its optimizer step; satellites pull
``v`` to join a batch and rollout engines pull the published version to load it in place
(``CellControl.LoadPolicy``). A pull in flight keeps its snapshot alive even when newer
versions push it out of the store, so a slow reader never sees a torn version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping

import grpc
import torch

from gyre.errors import InvalidArgument, NotFound, from_rpc_error
from gyre.grpcx.auth import AccessTable, allow
from gyre.grpcx.channel import dial
from gyre.grpcx.errors import rpc_stream
from gyre.grpcx.server import channel_options
from gyre.grpcx.tls import process_tls
from gyre.identity import Role
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "gyre.v1.WeightSnapshots"
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
"""Cap on one chunk's payload: well under the 16 MiB message limit every service sets."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype ("bfloat16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidArgument(f"unsupported snapshot dtype {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r}") from None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One immutable version: tensor names in order, each a contiguous CPU tensor."""

    version: int
    tensors: tuple[tuple[str, torch.Tensor], ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


class SnapshotStore:
    """The versions a core keeps (the newest ``keep``); thread-safe."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep >= 1")
        self._keep = keep
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, Snapshot] = OrderedDict()

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> Snapshot:
        """Freezes a copy of ``state`` as ``version``. Re-publishing a kept version is a no-op
        (versions are immutable); an older-than-newest version is refused."""
        if version < 0:
            raise InvalidArgument("snapshot versions are >= 0")
        with self._lock:
            if version in self._versions:
                return self._versions[version]
            newest = next(reversed(self._versions), 0)
            if version < newest:
                raise InvalidArgument(f"snapshot version {version} < newest {newest}")
        frozen = tuple((name, t.detach().to("cpu", copy=True).contiguous()) for name, t in state.items())
        snap = Snapshot(version, frozen)
        with self._lock:
            self._versions[version] = snap
            while len(self._versions) > self._keep:
                self._versions.popitem(last=False)
        return snap

    def get(self, version: int) -> Snapshot:
        """Version ``version`` (0: the newest, as on the wire; the initial policy is version 0
        and is the newest until the first step); NotFound when it is not kept."""
        with self._lock:
            if not self._versions:
                raise NotFound("no snapshot published yet")
            if version == 0:
                return next(reversed(self._versions.values()))
            snap = self._versions.get(version)
        if snap is None:
            raise NotFound(f"snapshot version {version} is not kept (have {self.versions()})")
        return snap

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    @property
    def newest(self) -> int:
        with self._lock:
            return next(reversed(self._versions), 0)


def iter_chunks(snap: Snapshot, chunk_bytes: int) -> Iterator[pb.WeightChunk]:
    """The wire form of a snapshot: every tensor in pieces of at most ``chunk_bytes``; an
    empty tensor is one chunk; the last chunk carries ``tensors_total``."""
    n = len(snap.tensors)
    for i, (name, t) in enumerate(snap.tensors):
        raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else None
        total = t.numel() * t.element_size()
        offset = 0
        while True:
            size = min(chunk_bytes, total - offset)
            last = i == n - 1 and offset + size >= total
            yield pb.WeightChunk(
                version=snap.version,
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                offset=offset,
                total_bytes=total,
                data=raw[offset : offset + size].tobytes() if raw is not None else b"",
                tensors_total=n if last else 0,
            )
            offset += size
            if offset >= total:
                break


class WeightSnapshotsServicer(pb_grpc.WeightSnapshotsServicer):
    """Serves ``PullSnapshot`` from a :class:`SnapshotStore`; only cells pull weights."""

    ACCESS = AccessTable(SERVICE_NAME, {"PullSnapshot": allow(Role.CELL_AGENT)})

    def __init__(self, store: SnapshotStore, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self._store = store
        self._max_chunk = max_chunk_bytes

    @rpc_stream
    async def PullSnapshot(  # noqa: N802 - gRPC method name
        self, request: pb.PullSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WeightChunk]:
        if request.version < 0:
            raise InvalidArgument("version must be >= 0")
        if request.chunk_bytes < 0:
            raise InvalidArgument("chunk_bytes must be >= 0")
        chunk = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, self._max_chunk)
        chunk = max(chunk, 4096)
        snap = self._store.get(request.version)
        for i, msg in enumerate(iter_chunks(snap, chunk)):
            yield msg
            if i % 64 == 63:
                await asyncio.sleep(0)  # let other calls run on a long pull

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_WeightSnapshotsServicer_to_server(self, server)


def registration(store: SnapshotStore) -> tuple[WeightSnapshotsServicer, object, str]:
    """The (servicer, add_to_server, name) triple GrpcServer and runtime.main take."""
    return (WeightSnapshotsServicer(store), pb_grpc.add_WeightSnapshotsServicer_to_server, SERVICE_NAME)


class _Assembly:
    """Reassembles one snapshot from its chunks, validating every piece."""

    def __init__(self, version: int) -> None:
        self.requested = version
        self.version = 0
        self.buffers: dict[str, tuple[str, list[int], bytearray, int]] = {}
        self.order: list[str] = []
        self.total: int | None = None

    def add(self, c: pb.WeightChunk) -> None:
        if self.version == 0:
            if self.requested and c.version != self.requested:
                raise InvalidArgument(f"asked for version {self.requested}, got {c.version}")
            self.version = c.version
        elif c.version != self.version:
            raise InvalidArgument("a snapshot stream mixed versions")
        if self.total is not None:
            raise InvalidArgument("chunk after the last chunk")
        entry = self.buffers.get(c.name)
        if entry is None:
            if c.total_bytes < 0 or c.offset != 0:
                raise InvalidArgument(f"{c.name}: first chunk must start at 0")
            entry = (c.dtype, list(c.shape), bytearray(c.total_bytes), 0)
            self.order.append(c.name)
        dtype, shape, buf, filled = entry
        if c.offset != filled or c.offset + len(c.data) > len(buf):
            raise InvalidArgument(f"{c.name}: chunk at {c.offset} out of order or too long")
        buf[c.offset : c.offset + len(c.data)] = c.data
        self.buffers[c.name] = (dtype, shape, buf, filled + len(c.data))
        if c.tensors_total:
            self.total = c.tensors_total

    def result(self) -> dict[str, torch.Tensor]:
        if self.total is None or self.total != len(self.order):
            raise InvalidArgument("snapshot stream ended early")
        out: dict[str, torch.Tensor] = {}
        for name in self.order:
            dtype_s, shape, buf, filled = self.buffers[name]
            if filled != len(buf):
                raise InvalidArgument(f"{name}: {filled} of {len(buf)} bytes")
            dtype = dtype_from_name(dtype_s)
            if len(buf) == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
        return out


async def pull_snapshot(
    target: str,
    version: int = 0,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = 120.0,
    channel: grpc.aio.Channel | None = None,
    max_message_bytes: int = 16 * 1024 * 1024,
) -> tuple[int, dict[str, torch.Tensor]]:
    """Pulls snapshot ``version`` (0: the newest) from the WeightSnapshots service at
    ``target``; returns (version, state dict of CPU tensors). Failures raise domain errors
    (NotFound when the version is no longer kept)."""
    own = channel is None
    ch = channel or dial(target, process_tls(), Role.CELL_AGENT, channel_options(max_message_bytes))
    try:
        stub = pb_grpc.WeightSnapshotsStub(ch)
        asm = _Assembly(version)
        call = stub.PullSnapshot(
            pb.PullSnapshotRequest(version=version, chunk_bytes=chunk_bytes), timeout=timeout_s
        )
        try:
            async for chunk in call:
                asm.add(chunk)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        finally:
            call.cancel()
        return asm.version, asm.result()
    finally:
        if own:
            await ch.close()
