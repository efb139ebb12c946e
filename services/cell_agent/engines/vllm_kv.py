"""KV handoff for the vLLM engine: Gyre's KV connector (vLLM's ``KVConnectorBase_V1``),
which moves a live request's whole KV cache (prompt and generated tokens, any length)
from one engine to another point to point, following the seed's protocol:

1. **pin** (source, before the request is cancelled): the front end
   (:meth:`VllmEngine.export_kv`) calls ``gyre_kv_pin`` through ``collective_rpc``; the
   pin is recorded in the process's :class:`PinTable` under a fresh handle id;
2. the router cancels the request; when vLLM finishes it, :meth:`request_finished` sees
   the pin and keeps the request's blocks (returns True: vLLM frees them only when the
   connector reports the request in ``finished_sending``); the worker seals the pin once
   the engine stepped past the request (**writes stopped**);
3. **read** (destination): the request arrives with the handle in its
   ``kv_transfer_params``; :meth:`get_num_new_matched_tokens` claims every whole block of
   the prompt but the last token as an asynchronous external load (the request waits in
   ``WAITING_FOR_REMOTE_KVS`` while the others keep running); the worker reads the blocks
   from the source's :class:`~.kv_transport.KvServer` in a thread straight into the
   blocks vLLM allocated; the source serves only the prefix its tokens share with the
   destination's;
4. **ack -> release**: after the destination's first token the router calls
   ``ReleaseKv`` at the source (``gyre_kv_release``); the worker reports the request in
   ``finished_sending`` and vLLM frees its blocks. A pin that nobody releases expires
   after its TTL (the same path), and a source that dies takes its blocks with it.

Failure never fails the call: a read that fails, times out, finds no pin or a token
mismatch is reported in ``failed_recving`` and vLLM recomputes the prompt (the destination
continues token-identically, only slower).

The scheduler-side and worker-side connectors share the process-wide :data:`TABLE`: this
needs the worker in the engine-core process (vLLM's ``UniProcExecutor``: one GPU per
engine, or the CPU engine); tensor-parallel engines would need the pin to travel to every
worker (not built). Transports: :mod:`.kv_transport` (``tcp`` here, ``nccl`` / ``cuda_ipc``
on GPUs), over mutual TLS between cell agents when the cell passes its identity.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from services.cell_agent.engines.kv_transport import (
    MEDIUMS,
    KvReadError,
    KvServer,
    KvTls,
    PagedCaches,
    PinTable,
    ReadSpec,
    read,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PARAMS_KEY = "gyre_kv"
"""The key of a Gyre handle in a request's ``kv_transfer_params``."""
IDLE_STEP_S = 0.002
"""Pause of an engine step that schedules nothing (the engine keeps stepping while it holds
pinned blocks or waits for a read; this keeps that from spinning a core)."""

TABLE = PinTable()
"""The pins of this engine process (scheduler and worker side share it)."""


@dataclasses.dataclass
class _Server:
    server: KvServer | None = None
    medium: str = "tcp"
    live: dict[str, Request] = dataclasses.field(default_factory=dict)
    """Requests the scheduler holds now, by vLLM's internal id."""


_SERVER = _Server()


def pin(request_ids: list[str], handle_id: str, ttl_s: float) -> tuple[str, str, int] | None:
    """Pins the running request (one of vLLM's internal ids for it) under ``handle_id``;
    returns (locator, medium, tokens computed so far) or None when it is not running."""
    if _SERVER.server is None:
        return None
    for rid in request_ids:
        req = _SERVER.live.get(rid)
        if req is not None and TABLE.pinned(rid) is None:
            TABLE.pin(handle_id, rid, ttl_s)
            return _SERVER.server.locator, _SERVER.medium, int(req.num_computed_tokens)
    return None


def release(handle_id: str) -> None:
    """Releases a pin (idempotent); held blocks are freed at the engine's next step."""
    TABLE.release(handle_id)


@dataclasses.dataclass(frozen=True)
class _Load:
    request_id: str
    spec: ReadSpec


@dataclasses.dataclass
class GyreKvMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: the reads to start, and whether the step is idle."""

    loads: list[_Load] = dataclasses.field(default_factory=list)
    idle: bool = False


class GyreKvConnector(KVConnectorBase_V1):
    """Pins, holds and serves a request's blocks at the source; reads them at the
    destination (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]  # vLLM passes None on some paths
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block = int(vllm_config.cache_config.block_size)
        self._medium = str(extra.get("medium", "tcp"))
        self._host = str(extra.get("host", "127.0.0.1"))
        self._read_timeout_s = float(extra.get("read_timeout_s", 10.0))
        tls = extra.get("tls")
        self._tls = KvTls(str(tls["cert_file"]), str(tls["key_file"]), str(tls["ca_file"])) if tls else None
        if self._medium not in MEDIUMS:
            raise ValueError(f"unknown KV medium {self._medium!r}")
        # Scheduler side.
        self._matched: dict[str, int] = {}
        self._tried: set[str] = set()
        self._pending: list[_Load] = []
        # Worker side.
        self._caches: PagedCaches | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reads: dict[str, tuple[concurrent.futures.Future[int], int]] = {}

    # Scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        _SERVER.live[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not params or request.request_id in self._tried:
            return 0, False
        # Every whole block but the one holding the last prompt token (it must be computed
        # to produce the next token).
        target = (len(request.prompt_token_ids or []) - 1) // self._block * self._block
        if target <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = target
        return target - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        rid = request.request_id
        target = self._matched.pop(rid)
        self._tried.add(rid)
        assert request.kv_transfer_params is not None  # matched above: it carried our params
        params = request.kv_transfer_params[PARAMS_KEY]
        first = (target - num_external_tokens) // self._block
        block_ids = blocks.get_block_ids()[0]
        spec = ReadSpec(
            locator=str(params["locator"]),
            handle_id=str(params["handle_id"]),
            medium=str(params["medium"]),
            token_ids=list(request.prompt_token_ids or [])[:target],
            first_block=first,
            dst_blocks=list(block_ids[first : target // self._block]),
            timeout_s=float(params.get("timeout_s", self._read_timeout_s)),
        )
        self._pending.append(_Load(rid, spec))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = GyreKvMetadata(self._pending, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        _SERVER.live.pop(rid, None)
        self._matched.pop(rid, None)
        self._tried.discard(rid)
        if TABLE.pinned(rid) is None:
            return False, None
        done = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0) or 0)
        tokens = list(request.all_token_ids[:done])
        return TABLE.finish(rid, tokens, list(block_ids), done), None

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = PagedCaches(dict(kv_caches), int(self._kv_cache_config.num_blocks))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gyre-kv-read")
        if _SERVER.server is None:
            _SERVER.server = KvServer(TABLE, self._caches, self._block, self._host, self._tls)
            _SERVER.medium = self._medium
            log.info("kv server listening", extra={"locator": _SERVER.server.locator, "medium": self._medium})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GyreKvMetadata)
        for load in meta.loads:
            assert self._pool is not None and self._caches is not None
            fut = self._pool.submit(read, load.spec, self._caches, self._tls)
            self._reads[load.request_id] = (fut, len(load.spec.dst_blocks))
        if meta.idle and not meta.loads:
            time.sleep(IDLE_STEP_S)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        TABLE.seal(finished_req_ids)
        TABLE.expire_unfinished()
        out = KVConnectorTransferResults(finished_sending=TABLE.take_releasable())
        for rid, (fut, want) in list(self._reads.items()):
            if not fut.done():
                continue
            del self._reads[rid]
            out.finished_recving.add(rid)
            try:
                got = fut.result()
            except Exception as exc:  # noqa: BLE001  (whatever went wrong with a read, the engine recomputes)
                level = logging.INFO if isinstance(exc, KvReadError) else logging.WARNING
                log.log(level, "kv read failed; recomputing", extra={"request_id": rid, "error": repr(exc)})
                got = -1
            if got != want:
                out.failed_recving.add(rid)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
