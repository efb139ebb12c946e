"""The router's test environment, shared by its integration and fault tests (registered as a
pytest plugin by tests/conftest.py; the helpers here are imported explicitly).

:class:`RouterEnv` is a router process (or several, on one config) in a fresh cluster on a
test's etcd, in front of deterministic fake engines (:class:`testkit.fake_engine.FakeEngineServer`)
and, unless told otherwise, a recording packer (:class:`testkit.fake_packer.FakePacker`)::

    async with RouterEnv(etcd_server.endpoint, tmp, "rh", engines=[FakeOptions(cell_id="a")],
                         retry_budget=0) as env:           # router settings as keywords
        ex, token = await env.routed("a")                 # a new execution routed to cell a
        events = await stream_completion(env.url, token, {"prompt": [20], "stream": True})

Everything it started stops when the block ends, the routers first; what a test adds
(a link proxy, a channel) stops with it through :meth:`RouterEnv.defer`. A test module
that needs more (routed executions, a proxy) subclasses it and sets its own attributes once
the environment is up. The calls the router's tests make over HTTP
(:func:`stream_completion`, :func:`stream_tokens`) and the unit tests' in-process API
(:func:`chat_api`) live here too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Self

import aiohttp

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.v1 import router_pb2_grpc
from services.router.http_api import OpenAIApi
from services.router.servicer import RouterServicer
from services.router.tokenization import Tokenizer
from testkit.fake_engine import FakeEngineServer, FakeOptions
from testkit.fake_packer import FakePacker
from testkit.router_rig import (
    build_tokenizer_dir,
    new_execution,
    put_route,
    read_sse,
    sse_token_ids,
    start_router,
    write_config,
)
from testkit.tls import RoleStubs, tls


class RouterEnv:
    """Fake engines (by cell id), a fake packer, ``routers`` router processes started side by
    side on one config (``cfg``: ``router`` settings over the defaults below), an etcd client
    of the cluster and a gRPC stub per router (as its real callers reach it)."""

    def __init__(
        self,
        etcd_endpoint: str,
        tmp: Path,
        prefix: str = "r",
        *,
        cluster: str | None = None,
        engines: Iterable[FakeOptions] = (),
        packer: bool = True,
        routers: int = 1,
        model: str = "model",
        **router: Any,
    ) -> None:
        """``prefix``: the start of the cluster's name, made unique with random hex digits
        (``cluster``: the whole name instead); ``packer``: a fake packer, and the routers
        record their turns there (False: none, unless ``router`` names a ``packer_target``);
        ``model``: the name of the tokenizer's directory (the model the routers serve)."""
        self.tmp = tmp
        self.cluster = cluster or prefix + secrets.token_hex(4)
        self.keys = Keys(self.cluster)
        self.etcd = Etcd([etcd_endpoint], 5.0)
        self.tok_dir = tmp / model
        self.cfg = tmp / "cluster.yaml"
        self.settings: dict[str, Any] = {"http_port": 0, "log_json": False, **router}
        """The routers' settings in ``cfg`` (those a test gave, and the defaults)."""
        self.engines: dict[str, FakeEngineServer] = {}
        self.routers: list[tuple[ServiceProcess, str]] = []
        """Each router process and its HTTP base URL, in the order started (a test that
        restarts one puts the new one in its place: it stops with the environment too)."""
        self.stubs: list[RoleStubs] = []
        """A ``Router`` gRPC stub per router, in the same order."""
        self._etcd_endpoint = etcd_endpoint
        self._engine_options = list(engines)
        self._with_packer = packer
        self._packer: FakePacker | None = None
        self._n_routers = routers
        self._started: list[ServiceProcess] = []
        self._stack = contextlib.AsyncExitStack()

    @property
    def packer(self) -> FakePacker:
        """The fake packer (the turns the routers recorded: ``packer.turns``)."""
        assert self._packer is not None, "this environment has no fake packer"
        return self._packer

    @property
    def engine(self) -> FakeEngineServer:
        """The first fake engine (the only one, in most tests)."""
        return next(iter(self.engines.values()))

    @property
    def proc(self) -> ServiceProcess:
        """The first router's process."""
        return self.routers[0][0]

    @property
    def url(self) -> str:
        """The first router's HTTP base URL (``.../v1``)."""
        return self.routers[0][1]

    @property
    def stub(self) -> RoleStubs:
        """The first router's gRPC stub."""
        return self.stubs[0]

    async def __aenter__(self) -> Self:
        await self._stack.__aenter__()
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._stop_routers()  # first: nothing they call goes away under them
        finally:
            await self._stack.aclose()

    async def _start(self) -> None:
        build_tokenizer_dir(self.tok_dir)
        if self._with_packer:
            self._packer = await FakePacker().start(tls("packer"))
            self.defer(self._packer.stop)
            self.settings.setdefault("packer_target", self._packer.target)
        for opts in self._engine_options:
            engine = self.engines[opts.cell_id] = await FakeEngineServer(opts).start()
            self.defer(engine.stop, 0)
        write_config(
            self.cfg, self.cluster, self._etcd_endpoint, model_dir=str(self.tok_dir), **self.settings
        )
        self.defer(self._stop_routers)  # (should a router's start fail)
        logs = ["router"] if self._n_routers == 1 else [f"router{i}" for i in range(self._n_routers)]
        for proc, url in await asyncio.gather(*(self._launch(log) for log in logs)):  # side by side
            self._adopt(proc, url)
        await self.etcd.connect()
        self.defer(self.etcd.close)

    def defer(self, callback: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Has ``callback(*args)`` awaited when the environment stops: once the routers have
        stopped, before what was started earlier stops."""
        self._stack.push_async_callback(callback, *args)

    async def add_router(self, log: str = "router", **overrides: Any) -> tuple[ServiceProcess, str]:
        """Starts one more router on ``cfg`` (``overrides``: its settings that differ; its
        log: ``tmp/<log>.log``) and its gRPC stub; returns the process and its HTTP base URL.
        It stops with the environment."""
        proc, url = await self._launch(log, **overrides)
        self._adopt(proc, url)
        return proc, url

    async def _launch(self, log: str, **overrides: Any) -> tuple[ServiceProcess, str]:
        proc, url = await asyncio.to_thread(start_router, self.cfg, self.tmp / f"{log}.log", **overrides)
        self._started.append(proc)
        return proc, url

    async def _stop_routers(self) -> None:
        """Stops every router this environment started and every one in ``routers`` now."""
        procs = {id(p): p for p in [*self._started, *(p for p, _ in self.routers)]}
        for proc in procs.values():
            await asyncio.to_thread(proc.stop)

    def _adopt(self, proc: ServiceProcess, url: str) -> None:
        self.routers.append((proc, url))
        self.stubs.append(RoleStubs(proc.target, router_pb2_grpc.RouterStub, RouterServicer.ACCESS))
        self.defer(self.stubs[-1].close)

    async def route(self, execution_id: str, cell: str, token: str, target: str | None = None) -> int:
        """Routes ``execution_id`` to ``cell`` as the scheduler does (at ``target``: by
        default that cell's fake engine); returns the route epoch."""
        target = target or self.engines[cell].target
        return await put_route(self.etcd, self.keys, execution_id, cell, target, token)

    async def routed(self, cell: str, target: str | None = None) -> tuple[str, str]:
        """A new execution routed to ``cell`` (see :meth:`route`): its id and token. The
        routers learn it through their watch: a call that comes first waits for it
        (``unknown_token_wait_s``)."""
        execution_id, token = new_execution()
        await self.route(execution_id, cell, token, target)
        return execution_id, token


async def stream_completion(
    url: str, token: str, body: dict[str, Any], path: str = "completions"
) -> list[dict[str, Any]]:
    """One call at a router's HTTP API (``url``: its base URL; ``body`` asks for a stream)
    with an execution's token; it must be answered (200): every SSE event of the answer."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/{path}", json=body, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200, await r.text()
        return await read_sse(r)


async def stream_tokens(
    url: str, token: str, body: dict[str, Any], after_line: Callable[[list[int]], Awaitable[None]]
) -> tuple[list[int], bool]:
    """One streamed completion at a router's HTTP API, read line by line: ``after_line(got)``
    is awaited after every line (``got``: the tokens received so far; where a test kills or
    moves something mid-stream). Returns the tokens received and whether the stream broke
    (``aiohttp.ClientError``) instead of ending."""
    got: list[int] = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200, await r.text()
        try:
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    got.extend(sse_token_ids([json.loads(line[6:])]))
                await after_line(got)
        except aiohttp.ClientError:
            return got, True
    return got, False


def chat_api(manager: Any, tok: Tokenizer) -> OpenAIApi:
    """The router's OpenAI API in process, over ``manager`` (a call manager, or a unit
    test's stand-in for it), serving "tiny" with the limits the unit tests assume: a body up
    to 1 MiB, prompts up to 4096 tokens, answers up to 64 (16 by default), 10 s a call."""
    return OpenAIApi(
        manager=manager,
        tokenizer=tok,
        model_name="tiny",
        max_body_bytes=1 << 20,
        max_prompt_tokens=4096,
        max_tokens_limit=64,
        default_max_tokens=16,
        request_timeout_s=10.0,
    )
