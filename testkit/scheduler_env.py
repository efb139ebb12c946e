"""Fixtures shared by tests across tiers (registered by tests/conftest.py): the surroundings
of scheduler processes under test.

:class:`SchedulerEnv` is a test's etcd client and cluster keys plus whatever the test starts
through it (fake cells, router and packer, scheduler processes with their harnesses, any
other stand-in it hands to :meth:`SchedulerEnv.track`); on the way out every held command
is released, every harness closed, every process stopped, every stand-in stopped and the
client closed, however the test ended. ``sched_env`` is the fixture (on the module's
``etcd_server``, the test's ``cluster_name`` and ``tmp_path``); :func:`scheduler_env` the same
as an async context manager, for tests whose event loop outlives the test's.

The move rig: :meth:`SchedulerEnv.move_cells` (an elastic core and a standalone ``sa-0`` of
two slots each) under :meth:`SchedulerEnv.move_config` (batches of 2, the waterlevel
policy); :meth:`SchedulerEnv.launch_four` fills both cells and :meth:`SchedulerEnv.start_move`
then sets the move of the core to training going."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest_asyncio

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.etcd.server import EtcdServer
from gyre.v1 import scheduler_pb2
from testkit.fake_packer import FakePacker
from testkit.scheduler_peers import FakeCellAgent, FakeRouter, Harness, connect, write_config
from testkit.tls import tls


class Stoppable(Protocol):
    async def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


@dataclasses.dataclass
class SchedulerEnv:
    """A test's etcd client and keys, and what it started (stopped by :meth:`close`)."""

    endpoint: str
    cluster: str
    tmp_path: Path
    etcd: Etcd
    keys: Keys
    cells: list[FakeCellAgent] = dataclasses.field(default_factory=list)
    peers: list[Stoppable] = dataclasses.field(default_factory=list)
    """Every stand-in to stop, in the order started (the cells among them)."""
    procs: list[ServiceProcess] = dataclasses.field(default_factory=list)
    harnesses: list[Harness] = dataclasses.field(default_factory=list)

    @property
    def history(self) -> Path:
        """Where a scheduler's JSONL history goes (``history_file=str(env.history)``)."""
        return self.tmp_path / "history.jsonl"

    def track(self, peer: S) -> S:
        """``peer``, stopped with the env."""
        self.peers.append(peer)
        return peer

    async def cell(
        self, cell_id: str, kind: str, index: int, slots: int, lease_ttl_s: int = 5
    ) -> FakeCellAgent:
        """A started :class:`FakeCellAgent`, registered in the env's cluster."""
        cell = await FakeCellAgent(self.etcd, self.keys, cell_id, kind, index, slots, lease_ttl_s).start()
        self.cells.append(cell)
        return self.track(cell)

    async def router(self) -> FakeRouter:
        """A started :class:`FakeRouter`, registered in the env's cluster."""
        return self.track(await FakeRouter(self.etcd, self.keys).start())

    async def packer(self) -> FakePacker:
        """A started :class:`FakePacker` with the packer's identity."""
        return self.track(await FakePacker().start(tls("packer")))

    def config(self, **scheduler: Any) -> Path:
        """The cluster YAML of this env's schedulers (``scheduler`` on top of
        :func:`testkit.scheduler_peers.write_config`'s defaults)."""
        return write_config(self.tmp_path, self.endpoint, self.cluster, **scheduler)

    async def start(
        self, cfg: Path, name: str = "scheduler", env: dict[str, str | None] | None = None
    ) -> tuple[ServiceProcess, Harness]:
        """A scheduler process (log ``<name>.log``) and a harness on it. Started off the event
        loop: a start takes seconds on a loaded machine, and the fakes' leases (refreshed on
        this loop) must not lapse meanwhile."""
        proc = ServiceProcess("scheduler", cfg, env=env, log_path=self.tmp_path / f"{name}.log", name=name)
        self.procs.append(proc)
        await asyncio.to_thread(proc.start)
        harness = Harness(proc.target)
        self.harnesses.append(harness)
        return proc, harness

    async def leader_and_standby(
        self,
        cfg: Path,
        leader_env: dict[str, str | None] | None = None,
        standby_env: dict[str, str | None] | None = None,
    ) -> tuple[ServiceProcess, Harness, ServiceProcess, Harness]:
        """``sched-a``, once it leads, then ``sched-b``, its standby."""
        a, ha = await self.start(cfg, "sched-a", leader_env)
        await ha.wait_leader()
        b, hb = await self.start(cfg, "sched-b", standby_env)
        return a, ha, b, hb

    async def route(self, execution_id: str) -> tuple[dict[str, Any] | None, int]:
        """An execution's route record and its version (``(None, 0)`` without one)."""
        kv = await self.etcd.get(self.keys.route(execution_id))
        return (json.loads(kv.value), kv.version) if kv is not None else (None, 0)

    async def cell_of(self, execution_id: str) -> str | None:
        """The cell an execution's route points at (None without a route)."""
        route, _ = await self.route(execution_id)
        return route["cell_id"] if route is not None else None

    async def move_cells(self, lease_ttl_s: int = 5) -> tuple[FakeCellAgent, FakeCellAgent]:
        """The cells of the move rig: an elastic ``core`` and a standalone ``sa-0``, two slots each."""
        core = await self.cell("core", "elastic", 0, 2, lease_ttl_s=lease_ttl_s)
        return core, await self.cell("sa-0", "standalone", -1, 2, lease_ttl_s=lease_ttl_s)

    def move_config(self, **scheduler: Any) -> Path:
        """The move rig's config: batches of 2 under the waterlevel policy (the move follows the
        seed's rule: capacity without the core >= W), ``scheduler`` on top."""
        return self.config(batch_size=2, policy="waterlevel", **scheduler)

    async def launch_four(
        self, h: Harness
    ) -> tuple[list[scheduler_pb2.Execution], list[scheduler_pb2.Execution]]:
        """Fills the move rig (sa-0 takes 2, the core 2): the executions on the core, the others."""
        got = [await h.acquire() for _ in range(4)]
        execs = [e for e in got if e is not None]
        assert len(execs) == 4, f"only {len(execs)} of 4 executions could be launched"
        on_core = [e for e in execs if await self.cell_of(e.execution_id) == "core"]
        return on_core, [e for e in execs if e not in on_core]

    async def start_move(self, h: Harness, packer: FakePacker) -> list[scheduler_pb2.Execution]:
        """Fills the move rig, finishes the executions on sa-0 (W = 2 = capacity without the
        core) and lets the packer's supply arrive: the leader moves the core to training. The
        executions on the core."""
        on_core, on_sa = await self.launch_four(h)
        for e in on_sa:
            await h.finish(e)
        packer.set_supply(2, 2)
        return on_core

    async def core_trains(self, core: FakeCellAgent) -> bool:
        """The move is over: the core is in training and its transition record is gone."""
        return core.state == "TRAINING" and await self.etcd.get(self.keys.transition("core")) is None

    async def close(self) -> None:
        """Releases every held command, closes the harnesses, stops the processes and the
        stand-ins, closes the client."""
        for cell in self.cells:
            for held in cell.hold.values():
                held.set()
        for h in self.harnesses:
            await h.close()
        for proc in self.procs:
            await asyncio.to_thread(proc.stop)
        for peer in self.peers:
            await peer.stop()
        await self.etcd.close()


@contextlib.asynccontextmanager
async def scheduler_env(endpoint: str, cluster: str, tmp_path: Path) -> AsyncIterator[SchedulerEnv]:
    """A :class:`SchedulerEnv` on etcd at ``endpoint``, closed on the way out."""
    env = SchedulerEnv(endpoint, cluster, tmp_path, await connect(endpoint), Keys(cluster))
    try:
        yield env
    finally:
        await env.close()


@pytest_asyncio.fixture
async def sched_env(
    etcd_server: EtcdServer, cluster_name: str, tmp_path: Path
) -> AsyncIterator[SchedulerEnv]:
    """A :class:`SchedulerEnv` on the module's etcd, for one test."""
    async with scheduler_env(etcd_server.endpoint, cluster_name, tmp_path) as env:
        yield env
