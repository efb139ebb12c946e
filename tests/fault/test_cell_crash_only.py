"""Crash-only cell agent: an engine that dies, or hangs (caught by the health probe that
generates a token), fails every waiter with a clear UNAVAILABLE error and the process exits
non-zero, taking its registration with it; a SIGKILLed cell disappears when its lease lapses."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import yaml

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from testkit.tls import channel

pytestmark = pytest.mark.timeout(120)


def write_config(tmp_path, etcd_server, cluster_name, mock=None, **cell) -> str:
    mock = mock or {}
    cfg = {
        "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        "cell_agent": {
            "cell_id": "cell-p",
            "engine": "mock",
            "mock": {"fixed_decode_step_s": 0.002, **mock},
            "lease_ttl_s": 3,
            "log_json": False,
            **cell,
        },
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


async def _waiters_fail(target: str, n: int = 3) -> list[grpc.StatusCode]:
    async with channel(target, "router") as ch:
        stub = pb_grpc.EngineStub(ch)

        async def one(i):
            req = pb.EngineGenerateRequest(
                request_id=f"r{i}",
                prompt_token_ids=[3, i + 4],
                sampling=common_pb2.SamplingParams(max_tokens=60000),
            )
            try:
                async for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""

        return await asyncio.gather(*[one(i) for i in range(n)])


@pytest.mark.parametrize("fault", ["die_after_tokens", "hang_after_tokens"])
async def test_dead_or_hung_engine_fails_waiters_and_exits(tmp_path, etcd_server, cluster_name, fault):
    path = write_config(
        tmp_path, etcd_server, cluster_name, probe_interval_s=0.3, probe_timeout_s=1.0, mock={fault: 200}
    )
    proc = ServiceProcess("cell_agent", path, log_path=tmp_path / "cell.log").start(timeout_s=60)
    etcd = Etcd([etcd_server.endpoint], timeout_s=2.0)
    await etcd.connect()
    try:
        results = await _waiters_fail(proc.target)
        for code, details in results:
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "engine" in details and ("died" in details or "timed out" in details or "dead" in details)
        rc = await asyncio.to_thread(proc.wait, 20)
        assert rc != 0
        assert await etcd.get(Keys(cluster_name).cell("cell-p")) is None
    finally:
        proc.kill()
        await etcd.close()


async def test_sigkilled_cell_disappears_after_its_lease(tmp_path, etcd_server, cluster_name):
    path = write_config(tmp_path, etcd_server, cluster_name, lease_ttl_s=2)
    proc = ServiceProcess("cell_agent", path, log_path=tmp_path / "cell.log").start(timeout_s=60)
    etcd = Etcd([etcd_server.endpoint], timeout_s=2.0)
    await etcd.connect()
    keys = Keys(cluster_name)
    try:
        assert json.loads((await etcd.get(keys.cell("cell-p"))).value)["target"] == proc.target
        proc.kill()
        deadline = time.monotonic() + 10
        while await etcd.get(keys.cell("cell-p")) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await etcd.get(keys.cell("cell-p")) is None
        assert await etcd.get(keys.cell_state("cell-p")) is None
    finally:
        proc.kill()
        await etcd.close()
