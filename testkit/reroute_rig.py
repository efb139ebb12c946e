"""A cluster for killing engines under a live stream: a real scheduler, router and cell agents
(mock engines) as processes on a real etcd. One *trial*: acquire an execution as a harness,
stream a model call through the router over gRPC, SIGKILL the cell agent serving it after
some tokens, and read the stream to its end. It records the gap from the kill to the first
token after it (served at the destination) and whether the harness saw any error; then a
fresh cell agent replaces the dead one, so trials can repeat.

Used by ``tests/fault/test_engine_death_reroute.py`` and ``bench/engine_reroute.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.identity import Role
from gyre.v1 import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from testkit.pki import BenchPki
from testkit.router_rig import build_tokenizer_dir

PROMPT = [30, 31, 32, 33]


@dataclasses.dataclass
class Trial:
    """One kill under a live stream."""

    tokens: int
    """Tokens the harness received in all."""
    error: str
    """The harness's error ('' when the response completed)."""
    gap_s: float
    """From the SIGKILL to the first token served after the reroute."""
    source: str
    destination: str
    reroutes: int


class RerouteRig:
    """Scheduler + router + cell agents; ``report`` turns the router's failure reports on."""

    def __init__(
        self,
        tmp: Path,
        etcd_endpoint: str,
        pki_root: Path,
        cluster: str,
        *,
        report: bool = True,
        lease_ttl_s: int = 10,
        decode_step_s: float = 0.01,
        slots: int = 8,
    ) -> None:
        self.tmp = tmp
        self.keys = Keys(cluster)
        self.pki = BenchPki(pki_root)
        self.etcd_endpoint = etcd_endpoint
        self._cells: dict[str, ServiceProcess] = {}
        self._next_cell = 0
        self.procs: list[ServiceProcess] = []
        common = {"lease_ttl_s": lease_ttl_s, "log_json": False, "log_level": "INFO"}
        config = {
            "cluster": {"name": cluster, "etcd_endpoints": [etcd_endpoint], "tls": {"dir": self.pki.tls_dir}},
            "scheduler": {
                **common,
                "policy": "rollout_only",
                "batch_size": 64,
                "group_size": 2,
                "over_provision": 0.0,
                "reconcile_s": 0.1,
                "heartbeat_deadline_s": 600.0,
            },
            "router": {
                **common,
                "model_dir": str(build_tokenizer_dir(tmp / "model")),
                "http_port": 0,
                "report_engine_failures": report,
                "failover_wait_s": 30.0,
                "retry_budget": 3,
            },
            "cell_agent": {
                **common,
                "kind": "standalone",
                "index": -1,
                "slots": slots,
                "engine": "mock",
                "mock": {"fixed_decode_step_s": decode_step_s},
                "probe_interval_s": 0.5,
            },
        }
        self.config = tmp / "reroute.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.etcd: Etcd | None = None
        self._channels: list[grpc.aio.Channel] = []

    def _start(self, service: str, name: str, **overrides: Any) -> ServiceProcess:
        proc = ServiceProcess(
            service, self.config, overrides=overrides, log_path=self.tmp / f"{name}.log", name=name
        ).start(timeout_s=90)
        self.procs.append(proc)
        return proc

    def add_cell(self) -> str:
        cell_id = f"sa-{self._next_cell}"
        self._next_cell += 1
        self._cells[cell_id] = self._start("cell_agent", cell_id, cell_id=cell_id)
        return cell_id

    async def start(self, cells: int = 2) -> None:
        for _ in range(cells):
            self.add_cell()
        self.router = self._start("router", "router")
        self.scheduler = self._start("scheduler", "scheduler")
        self.etcd = Etcd([self.etcd_endpoint], 5.0)
        await self.etcd.connect()
        harness = self.pki.channel(self.scheduler.target, "harness", Role.HARNESS, Role.SCHEDULER)
        to_router = self.pki.channel(self.router.target, "harness", Role.HARNESS, Role.ROUTER)
        self._channels += [harness, to_router]
        self.harness = scheduler_pb2_grpc.HarnessServiceStub(harness)
        self.router_stub = router_pb2_grpc.RouterStub(to_router)
        await self._wait_cells(cells)

    async def _wait_cells(self, n: int, timeout_s: float = 60.0) -> None:
        assert self.etcd is not None
        deadline = time.monotonic() + timeout_s
        while True:
            _, kvs = await self.etcd.get_prefix(self.keys.cell_states())
            live = [kv for kv in kvs if json.loads(kv.value).get("state") == "ROLLOUT"]
            if len(live) >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(live)} of {n} cells in rollout")
            await asyncio.sleep(0.2)

    async def acquire(self) -> scheduler_pb2.Execution:
        for _ in range(300):
            try:
                got = await self.harness.AcquireExecution(
                    scheduler_pb2.AcquireExecutionRequest(harness_id="reroute", wait_s=5.0), timeout=10
                )
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.2)
                continue
            if got.HasField("execution"):
                return got.execution
        raise TimeoutError("no execution")

    async def cell_of(self, execution_id: str) -> str:
        assert self.etcd is not None
        kv = await self.etcd.get(self.keys.route(execution_id))
        assert kv is not None, execution_id
        return str(json.loads(kv.value)["cell_id"])

    async def trial(self, max_tokens: int = 300, kill_after: int = 40) -> Trial:
        """Kills the serving cell after ``kill_after`` tokens; replaces it afterwards."""
        ex = await self.acquire()
        source = await self.cell_of(ex.execution_id)
        call = self.router_stub.Generate(
            router_pb2.GenerateRequest(
                execution_id=ex.execution_id,
                prompt_token_ids=PROMPT,
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
            ),
            metadata=(("authorization", f"Bearer {ex.token}"),),
            timeout=120,
        )
        tokens, error, t_kill, first_after, reroutes, at_kill = 0, "", 0.0, 0.0, 0, -1
        try:
            async for msg in call:
                now = time.monotonic()
                n = len(msg.chunk.token_ids)
                # The first token served after the reroute (tokens the source sent before
                # it died may still arrive after the kill: they carry the old count).
                if t_kill and n and not first_after and msg.reroutes > at_kill:
                    first_after = now
                tokens += n
                reroutes = msg.reroutes
                if not t_kill and tokens >= kill_after:
                    t_kill = time.monotonic()
                    self._cells[source].signal(signal.SIGKILL)  # no wait: the loop keeps reading
                    at_kill = msg.reroutes
        except grpc.aio.AioRpcError as err:
            error = f"{err.code().name}: {err.details()}"
        destination = await self.cell_of(ex.execution_id) if not error else ""
        await self._finish(ex)
        self._cells.pop(source).kill()  # reap it
        self.add_cell()
        await self._wait_cells(len(self._cells))
        return Trial(
            tokens,
            error,
            (first_after - t_kill) if first_after else float("nan"),
            source,
            destination,
            reroutes,
        )

    async def _finish(self, ex: scheduler_pb2.Execution) -> None:
        req = scheduler_pb2.FinishExecutionRequest(
            execution_id=ex.execution_id,
            reward=1.0,
            idempotency_key="f",
            status=common_pb2.EXECUTION_STATUS_COMPLETED,
        )
        try:
            await self.harness.FinishExecution(
                req, metadata=(("authorization", f"Bearer {ex.token}"),), timeout=10
            )
        except grpc.aio.AioRpcError:
            pass  # a trial's verdict does not depend on it

    async def stop(self) -> None:
        for channel in self._channels:
            await channel.close()
        for proc in reversed(self.procs):
            proc.stop()
        if self.etcd is not None:
            await self.etcd.close()
