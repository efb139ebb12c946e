"""Point-to-point transfer of pinned KV-cache blocks between two engines: one interface,
three transports.

The source engine's KV connector (:mod:`.vllm_kv`) pins a request's blocks in a
:class:`PinTable` and serves them from a :class:`KvServer` (a TCP listener in the process
that owns the paged KV cache); the destination's connector calls :func:`read` with the
handle, its own token ids and the blocks to fill. Every transport shares the control
exchange over that TCP connection (what to read, whether the source still has it, how many
blocks it can serve); only the bulk data path differs:

* ``tcp``: the blocks' bytes on the same stream (CPU engines; any two hosts; on GPUs it
  stages through host memory);
* ``nccl``: NCCL point-to-point send/recv between the two GPUs, over a two-rank group that
  vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` build for the read (no global
  process group is touched);
* ``cuda_ipc``: same node: the source shares its KV-cache tensors once as CUDA IPC handles;
  the destination maps them and copies the pinned blocks device to device.

With TLS files (the cell agent passes its own identity), the TCP stream is mutual TLS and
both ends must hold a ``cell-agent`` certificate of the cluster's CA; the handle id (128
random bits, passed only over mTLS gRPC) is the capability that names a pin.

The source answers a read only after the request's writes stopped (the pin is *sealed*),
serves at most the longest block-aligned prefix its tokens share with the destination's,
and counts the read in the pin so the blocks cannot be released mid-copy. A missing or
released pin, a timeout, a dead source or a token mismatch all end as :class:`KvReadError`
(the destination then recomputes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import socketserver
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from gyre.ports import free_port

log = logging.getLogger(__name__)

MEDIUMS = ("tcp", "nccl", "cuda_ipc")
_LEN = struct.Struct("!I")
_MAX_CONTROL = 64 << 20


class KvReadError(Exception):
    """A read that did not fill the blocks (the destination recomputes them)."""


# Pinned blocks ----------------------------------------------------------------------------


@dataclasses.dataclass
class Pin:
    """One export: a request's blocks held for a destination."""

    handle_id: str
    request_id: str
    deadline: float
    token_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    """Tokens whose KV the blocks hold (set when the request finished)."""
    held: bool = False
    """The engine kept the blocks for this pin (they are freed only through the pin)."""
    sealed: bool = False
    """Writes stopped: the request finished and its last step ran."""
    released: bool = False
    reads: int = 0


class PinTable:
    """The pins of one engine process, shared by its scheduler and its worker (and the
    server thread that reads them). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_handle: dict[str, Pin] = {}
        self._by_request: dict[str, Pin] = {}

    def pin(self, handle_id: str, request_id: str, ttl_s: float) -> Pin:
        with self._cond:
            p = Pin(handle_id, request_id, time.monotonic() + ttl_s)
            self._by_handle[handle_id] = p
            self._by_request[request_id] = p
            return p

    def pinned(self, request_id: str) -> Pin | None:
        with self._cond:
            return self._by_request.get(request_id)

    def finish(self, request_id: str, token_ids: list[int], block_ids: list[int], num_tokens: int) -> bool:
        """The request finished: True when a live pin keeps its blocks."""
        with self._cond:
            p = self._by_request.get(request_id)
            if p is None or p.released:
                self._drop(p)
                return False
            p.token_ids, p.block_ids, p.num_tokens = token_ids, block_ids, num_tokens
            p.held = bool(block_ids)
            if not p.held:
                p.sealed = True  # nothing to wait for, nothing to serve
                self._cond.notify_all()
            return p.held

    def seal(self, request_ids: set[str]) -> None:
        """The engine ran its first step after these requests finished: their blocks are
        written for good."""
        with self._cond:
            for rid in request_ids:
                p = self._by_request.get(rid)
                if p is not None and p.held:
                    p.sealed = True
            self._cond.notify_all()

    def release(self, handle_id: str) -> None:
        with self._cond:
            p = self._by_handle.get(handle_id)
            if p is None:
                return
            p.released = True
            if not p.held:
                self._drop(p)
            self._cond.notify_all()

    def take_releasable(self) -> set[str]:
        """Request ids whose held blocks can be freed now: released or expired, and not
        being read."""
        now = time.monotonic()
        out: set[str] = set()
        with self._cond:
            for p in list(self._by_handle.values()):
                if p.deadline <= now:
                    p.released = True
                if p.released and p.reads == 0 and (p.sealed or not p.held):
                    if p.held:
                        out.add(p.request_id)
                    self._drop(p)
            self._cond.notify_all()
        return out

    def expire_unfinished(self) -> None:
        """Drops expired pins of requests that never finished (nothing is held)."""
        now = time.monotonic()
        with self._cond:
            for p in list(self._by_handle.values()):
                if p.deadline <= now and not p.held:
                    self._drop(p)

    def __len__(self) -> int:
        with self._cond:
            return len(self._by_handle)

    def _drop(self, p: Pin | None) -> None:
        if p is None:
            return
        self._by_handle.pop(p.handle_id, None)
        if self._by_request.get(p.request_id) is p:
            self._by_request.pop(p.request_id, None)

    @contextlib.contextmanager
    def reading(self, handle_id: str, timeout_s: float) -> Iterator[Pin]:
        """Waits (up to ``timeout_s``) until the pin is sealed and holds it while read."""
        until = time.monotonic() + timeout_s
        with self._cond:
            while True:
                p = self._by_handle.get(handle_id)
                if p is None or p.released:
                    raise KvReadError(f"no live pin {handle_id}")
                if p.sealed:
                    break
                left = until - time.monotonic()
                if left <= 0:
                    raise KvReadError(f"pin {handle_id} not sealed within {timeout_s}s")
                self._cond.wait(left)
            p.reads += 1
        try:
            yield p
        finally:
            with self._cond:
                p.reads -= 1
                self._cond.notify_all()


# The paged cache --------------------------------------------------------------------------


class PagedCaches:
    """The per-layer paged KV-cache tensors of an engine and their block dimension."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.tensors = tensors
        self.block_dim = {name: _block_dim(t, num_blocks) for name, t in tensors.items()}

    def gather(self, name: str, block_ids: list[int]) -> torch.Tensor:
        t = self.tensors[name]
        idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        return t.index_select(self.block_dim[name], idx).contiguous()

    def scatter(self, name: str, block_ids: list[int], data: torch.Tensor) -> None:
        t = self.tensors[name]
        idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        t.index_copy_(self.block_dim[name], idx, data.to(t.device))

    def shape_of(self, name: str, n_blocks: int) -> list[int]:
        shape = list(self.tensors[name].shape)
        shape[self.block_dim[name]] = n_blocks
        return shape


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    for dim in (0, 1):
        if t.dim() > dim and t.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no block dimension of size {num_blocks} in a KV cache of shape {tuple(t.shape)}")


def common_blocks(mine: list[int], theirs: list[int], available: int, block_size: int) -> int:
    """Whole blocks of the longest common prefix of two token sequences, within the
    ``available`` tokens whose KV is written."""
    limit = min(len(mine), len(theirs), available)
    n = 0
    while n < limit and mine[n] == theirs[n]:
        n += 1
    return n // block_size


# Mutual TLS -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KvTls:
    """The PEM files of this engine's identity and the CA it trusts."""

    cert_file: str
    key_file: str
    ca_file: str

    def context(self, server: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(self.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.check_hostname = False  # peers are checked by the role their certificate names
        return ctx


def _check_peer(sock: socket.socket) -> None:
    """Only cell agents may read or serve KV blocks."""
    if not isinstance(sock, ssl.SSLSocket):
        return
    from cryptography import x509

    from gyre.certs import identity_of
    from gyre.identity import Role

    der = sock.getpeercert(binary_form=True)
    if der is None or identity_of(x509.load_der_x509_certificate(der)).role is not Role.CELL_AGENT:
        raise KvReadError("the KV peer is not a cell agent")


# Framing ----------------------------------------------------------------------------------


def _send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise KvReadError("connection closed mid-transfer")
        got += n


def _recv_msg(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > _MAX_CONTROL:
        raise KvReadError(f"control message of {n} bytes")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    return json.loads(body)


def _send_tensor(sock: socket.socket, t: torch.Tensor) -> None:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    sock.sendall(flat.numpy().data)


def _recv_tensor(sock: socket.socket, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    buf = torch.empty(n * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
    _recv_exact(sock, buf.numpy().data)
    return buf.view(dtype).reshape(shape)


_DTYPES = {
    str(d): d
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn)
}


# The source: one server per engine --------------------------------------------------------


class KvServer:
    """Serves the pinned blocks of one engine to destinations (thread per connection)."""

    def __init__(
        self,
        table: PinTable,
        caches: PagedCaches,
        block_size: int,
        host: str = "127.0.0.1",
        tls: KvTls | None = None,
    ) -> None:
        self.table = table
        self.caches = caches
        self.block_size = block_size
        self._tls = tls.context(server=True) if tls is not None else None
        self._ipc_handles: dict[str, Any] | None = None
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.locator = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="gyre-kv-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self._tls is not None:
                sock.settimeout(10.0)
                sock = self._tls.wrap_socket(sock, server_side=True)
                _check_peer(sock)
            req = _recv_msg(sock)
            timeout_s = float(req["timeout_s"])
            sock.settimeout(timeout_s)
            # Half the read's deadline for the seal, so a refusal reaches the reader in time.
            with self.table.reading(str(req["handle"]), timeout_s / 2) as pin:
                self._answer(sock, req, pin)
        except (KvReadError, OSError, ValueError, KeyError, RuntimeError) as exc:
            with contextlib.suppress(OSError):
                _send_msg(sock, {"ok": False, "error": str(exc)})
            log.info("kv read refused", extra={"error": str(exc)})
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _answer(self, sock: socket.socket, req: dict[str, Any], pin: Pin) -> None:
        first, want = int(req["first_block"]), int(req["blocks"])
        have = common_blocks(pin.token_ids, req["tokens"], pin.num_tokens, self.block_size)
        have = min(have, len(pin.block_ids))
        n = max(0, min(first + want, have) - first)
        src_blocks = pin.block_ids[first : first + n]
        names = [name for name in req["layers"] if name in self.caches.tensors]
        if len(names) != len(req["layers"]):
            raise KvReadError("layer names differ between the engines")
        medium = req.get("medium", "tcp")
        layers = [
            {
                "name": name,
                "shape": self.caches.shape_of(name, n),
                "dtype": str(self.caches.tensors[name].dtype),
            }
            for name in names
        ]
        head: dict[str, Any] = {"ok": True, "blocks": n, "layers": layers}
        if n == 0:
            _send_msg(sock, head)
            return
        _sync(self._device())  # the engine's last kernels on these blocks are done
        if medium == "tcp":
            _send_msg(sock, head)
            for name in names:
                _send_tensor(sock, self.caches.gather(name, src_blocks))
        elif medium == "cuda_ipc":
            head["ipc"] = self._share_caches()
            head["src_blocks"] = src_blocks
            _send_msg(sock, head)
            _recv_msg(sock)  # the destination copied: the blocks may go
        elif medium == "nccl":
            _send_msg(sock, head)
            rendezvous = _recv_msg(sock)
            comm = _nccl_pair(rendezvous["host"], int(rendezvous["port"]), rank=1, device=self._device())
            for name in names:
                comm.send(self.caches.gather(name, src_blocks), dst=0)
            _sync(self._device())
            _recv_msg(sock)
        else:
            raise KvReadError(f"unknown medium {medium!r}")

    def _device(self) -> torch.device:
        return next(iter(self.caches.tensors.values())).device

    def _share_caches(self) -> dict[str, str]:
        """CUDA IPC handles of every layer's cache tensor (made once; they stay valid while
        the engine lives)."""
        if self._ipc_handles is None:
            import base64
            import pickle

            from torch.multiprocessing.reductions import reduce_tensor

            self._ipc_handles = {
                name: base64.b64encode(pickle.dumps(reduce_tensor(t))).decode()
                for name, t in self.caches.tensors.items()
            }
        return self._ipc_handles


# The destination --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """What a destination reads: the handle, its tokens (the prefix to cover), and which of
    its blocks to fill (``dst_blocks[i]`` receives block ``first_block + i``)."""

    locator: str
    handle_id: str
    medium: str
    token_ids: list[int]
    first_block: int
    dst_blocks: list[int]
    timeout_s: float


def read(spec: ReadSpec, caches: PagedCaches, tls: KvTls | None = None) -> int:
    """Fills ``spec.dst_blocks`` from the source; returns how many leading blocks were
    filled (all of them, or the prefix the source could serve). Raises KvReadError."""
    if spec.medium not in MEDIUMS:
        raise KvReadError(f"medium {spec.medium!r} is not supported here")
    host, _, port = spec.locator.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=spec.timeout_s) as raw:
            sock = tls.context(server=False).wrap_socket(raw) if tls is not None else raw
            sock.settimeout(spec.timeout_s)
            _check_peer(sock)
            names = list(caches.tensors)
            _send_msg(
                sock,
                {
                    "handle": spec.handle_id,
                    "tokens": spec.token_ids,
                    "first_block": spec.first_block,
                    "blocks": len(spec.dst_blocks),
                    "layers": names,
                    "medium": spec.medium,
                    "timeout_s": spec.timeout_s,
                },
            )
            head = _recv_msg(sock)
            if not head.get("ok"):
                raise KvReadError(f"source refused: {head.get('error')}")
            n = int(head["blocks"])
            if n == 0:
                return 0
            dst = spec.dst_blocks[:n]
            layers = head["layers"]
            for layer in layers:
                if list(layer["shape"]) != caches.shape_of(layer["name"], n):
                    raise KvReadError(f"KV layout differs for {layer['name']}: {layer['shape']}")
            if spec.medium == "tcp":
                for layer in layers:
                    data = _recv_tensor(sock, layer["shape"], _DTYPES[layer["dtype"]])
                    caches.scatter(layer["name"], dst, data)
                _sync(next(iter(caches.tensors.values())).device)
            elif spec.medium == "cuda_ipc":
                _copy_from_ipc(head, caches, dst)
                _send_msg(sock, {"done": True})
            else:
                _read_nccl(sock, layers, caches, dst)
            return n
    except (OSError, ValueError, KeyError) as exc:
        raise KvReadError(f"kv read from {spec.locator} failed: {exc!r}") from exc


_IPC_CACHE: dict[str, torch.Tensor] = {}
"""Source cache tensors mapped into this process, by their IPC handle."""


def _copy_from_ipc(head: dict[str, Any], caches: PagedCaches, dst: list[int]) -> None:
    import base64
    import pickle

    src_blocks = list(head["src_blocks"])
    for layer in head["layers"]:
        name = layer["name"]
        blob = head["ipc"][name]
        src = _IPC_CACHE.get(blob)
        if src is None:
            fn, args = pickle.loads(base64.b64decode(blob))
            src = _IPC_CACHE[blob] = fn(*args)
        idx = torch.tensor(src_blocks, dtype=torch.long, device=src.device)
        caches.scatter(name, dst, src.index_select(caches.block_dim[name], idx))
    _sync(next(iter(caches.tensors.values())).device)


def _read_nccl(
    sock: socket.socket, layers: list[dict[str, Any]], caches: PagedCaches, dst: list[int]
) -> None:
    device = next(iter(caches.tensors.values())).device
    host = sock.getsockname()[0]
    port = free_port(host)
    _send_msg(sock, {"host": host, "port": port})
    comm = _nccl_pair(host, port, rank=0, device=device)
    for layer in layers:
        buf = torch.empty(layer["shape"], dtype=_DTYPES[layer["dtype"]], device=device)
        comm.recv(buf, src=1)
        caches.scatter(layer["name"], dst, buf)
    _sync(device)
    _send_msg(sock, {"done": True})


def _nccl_pair(host: str, port: int, rank: int, device: torch.device) -> Any:
    """A two-rank NCCL communicator (rank 0: the destination, which hosts the rendezvous
    store) that touches no global process group."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2)
    return PyNcclCommunicator(group, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
