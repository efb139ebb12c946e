"""The cell agent as a real process (mock engine) against a real etcd: it registers itself
(lease-bound) and enters ROLLOUT; Generate streams over gRPC; role commands are fenced
against the scheduler leader key (a stale epoch is refused and changes nothing in etcd);
malformed requests get precise statuses and change nothing; a clean stop removes its keys."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from services.cell_agent.servicer import CellControlServicer, EngineServicer
from testkit.cell_config import write_cell_config as write_config
from testkit.tls import RoleStubs

pytestmark = pytest.mark.timeout(120)


async def _generate(stub, rid, prompt, n, **kw):
    req = pb.EngineGenerateRequest(
        request_id=rid,
        execution_id="e1",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=n),
        **kw,
    )
    return [c async for c in stub.Generate(req, timeout=30)]


async def test_cell_agent_process(tmp_path, etcd_server, cluster_name):
    from gyre.ports import free_port

    metrics_port = free_port()
    path = write_config(tmp_path, etcd_server, cluster_name, metrics_port=metrics_port)
    proc = ServiceProcess("cell_agent", path, log_path=tmp_path / "cell.log").start(timeout_s=60)
    etcd = Etcd([etcd_server.endpoint], timeout_s=2.0)
    await etcd.connect()
    keys = Keys(cluster_name)
    try:
        reg = json.loads((await etcd.get(keys.cell("cell-p"))).value)
        assert reg == {
            "cell_id": "cell-p",
            "kind": "elastic",
            "index": 0,
            "slots": 4,
            "target": proc.target,
            "engine": "mock",
            "policy_version": 0,
            "kv_tokens": 1 << 20,  # the mock's prefix cache: where it keeps its KV
        }
        assert json.loads((await etcd.get(keys.cell_state("cell-p"))).value)["state"] == "ROLLOUT"

        async with (
            RoleStubs(proc.target, pb_grpc.EngineStub, EngineServicer.ACCESS) as engine,
            RoleStubs(proc.target, pb_grpc.CellControlStub, CellControlServicer.ACCESS) as control,
        ):
            chunks = await _generate(engine, "r1", [5, 6, 7], 10)
            assert sum(len(c.token_ids) for c in chunks) == 10
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            load = await engine.GetLoad(pb.GetLoadRequest(), timeout=20)
            assert (load.cell_id, load.slots, load.accepting, load.engine) == ("cell-p", 4, True, "mock")

            # Bad input: precise statuses.
            for req, code in [
                (
                    pb.EngineGenerateRequest(
                        request_id="", prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=1)
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    pb.EngineGenerateRequest(
                        request_id="x", prompt_token_ids=[], sampling=common_pb2.SamplingParams(max_tokens=1)
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    pb.EngineGenerateRequest(request_id="x", prompt_token_ids=[1]),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    pb.EngineGenerateRequest(
                        request_id="x",
                        prompt_token_ids=[1],
                        sampling=common_pb2.SamplingParams(max_tokens=1, top_p=2.0),
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    pb.EngineGenerateRequest(
                        request_id="x",
                        prompt_token_ids=[1] * 200_000,
                        sampling=common_pb2.SamplingParams(max_tokens=1),
                    ),
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                ),
                (
                    pb.EngineGenerateRequest(
                        request_id="x",
                        prompt_token_ids=[1],
                        required_policy_version=9,
                        sampling=common_pb2.SamplingParams(max_tokens=1),
                    ),
                    grpc.StatusCode.FAILED_PRECONDITION,
                ),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await engine.Generate(req, timeout=20).read()
                assert err.value.code() == code, req
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await control.SetState(pb.SetStateRequest(target=common_pb2.CELL_STATE_DRAINING), timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await control.SetState(pb.SetStateRequest(fence=common_pb2.Fence(epoch=5)), timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # Fenced role commands.
            lease = LeaseKeeper(etcd, ttl_s=10)
            await lease.grant()
            leader = LeaderElection(etcd, keys.leader(), "sched", lease)
            epoch = await leader.campaign()
            fence = common_pb2.Fence(epoch=epoch)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # not the leader key's revision
                await control.SetState(
                    pb.SetStateRequest(
                        fence=common_pb2.Fence(epoch=epoch + 1000), target=common_pb2.CELL_STATE_DRAINING
                    ),
                    timeout=20,
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert json.loads((await etcd.get(keys.cell_state("cell-p"))).value)["state"] == "ROLLOUT"
            with pytest.raises(grpc.aio.AioRpcError) as err:  # illegal in ROLLOUT
                await control.SetState(
                    pb.SetStateRequest(
                        fence=common_pb2.Fence(epoch=epoch), target=common_pb2.CELL_STATE_TRAINING
                    ),
                    timeout=20,
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            for target in (common_pb2.CELL_STATE_DRAINING, common_pb2.CELL_STATE_TRAINING):
                got = await control.SetState(pb.SetStateRequest(fence=fence, target=target), timeout=20)
                assert got.state == target
            status = await control.GetCellStatus(pb.GetCellStatusRequest(), timeout=20)
            assert (status.state, status.epoch, status.load.accepting) == (
                common_pb2.CELL_STATE_TRAINING,
                epoch,
                False,
            )
            assert json.loads((await etcd.get(keys.cell_state("cell-p"))).value) | {"updated_s": 0} == {
                "state": "TRAINING",
                "epoch": epoch,
                "updated_s": 0,
            }
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(engine, "r2", [5], 3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            joined = await control.JoinBatch(
                pb.JoinBatchRequest(fence=fence, batch_id=1, policy_version=1, prefix_size=1), timeout=20
            )
            assert joined.joined in (True, False)
            for target in (common_pb2.CELL_STATE_RETURNING, common_pb2.CELL_STATE_ROLLOUT):
                await control.SetState(pb.SetStateRequest(fence=fence, target=target), timeout=20)
            got = await control.LoadPolicy(pb.LoadPolicyRequest(fence=fence, version=3), timeout=20)
            assert got.policy_version == 3
            assert json.loads((await etcd.get(keys.cell("cell-p"))).value)["policy_version"] == 3
            chunks = await _generate(engine, "r3", [5, 6, 7], 4)
            assert {c.policy_version for c in chunks} == {3}
            await leader.resign()
            await lease.revoke()

        # Prometheus metrics mirror the cell.
        import aiohttp

        await asyncio.sleep(1.2)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        assert 'gyre_cell_state{cell_id="cell-p",state="ROLLOUT"} 1.0' in text
        assert 'gyre_cell_policy_version{cell_id="cell-p"} 3.0' in text
        assert 'gyre_cell_role_transitions{cell_id="cell-p"} 5.0' in text
        assert proc.stop() == 0
        assert await etcd.get(keys.cell("cell-p")) is None
        assert await etcd.get(keys.cell_state("cell-p")) is None
    finally:
        proc.kill()
        await etcd.close()
