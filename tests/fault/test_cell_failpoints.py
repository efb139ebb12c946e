"""A cell agent dies at its role-change failpoint (the new state is in etcd, not yet acted
on) and is restarted, as the supervisor does: the new incarnation records itself STARTING ->
ROLLOUT over the stale state in etcd, the scheduler's retried command is obeyed (the same
target from ROLLOUT) or refused with FAILED_PRECONDITION (a target not reachable from
ROLLOUT: the scheduler decides again), the move then goes through, and the cell's history
(two incarnations) checks clean."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import yaml

from apps.checker import check_files
from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper
from gyre.failpoints import EXIT_STATUS, FAILPOINT_FILE_ENV
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2 as cpb
from testkit.tls import channel

pytestmark = pytest.mark.timeout(120)
S = cpb.CellState


async def _state(etcd: Etcd, keys: Keys) -> str:
    kv = await etcd.get(keys.cell_state("cell-f"))
    return "" if kv is None else json.loads(kv.value)["state"]


async def _set(target: str, fence: cpb.Fence, state: int) -> pb.SetStateResponse:
    async with channel(target, "scheduler") as ch:
        stub = pb_grpc.CellControlStub(ch)
        return await stub.SetState(pb.SetStateRequest(fence=fence, target=state), timeout=30)


@pytest.mark.parametrize("dies_entering", ["DRAINING", "TRAINING"])
async def test_cell_dies_at_a_role_change_failpoint(dies_entering, tmp_path, etcd_server, cluster_name):
    armed = tmp_path / "failpoints"
    hist = tmp_path / "cells.jsonl"
    path = tmp_path / "cluster.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
                "cell_agent": {
                    "cell_id": "cell-f",
                    "kind": "elastic",
                    "index": 0,
                    "engine": "mock",
                    "mock": {"fixed_decode_step_s": 0.002},
                    "drain_wait_s": 1.0,
                    "log_json": False,
                    "history_file": str(hist),
                },
            }
        )
    )
    proc = ServiceProcess(
        "cell_agent", path, env={FAILPOINT_FILE_ENV: str(armed)}, log_path=tmp_path / "cell.log"
    )
    await asyncio.to_thread(proc.start, 60)
    etcd = Etcd([etcd_server.endpoint], timeout_s=5.0)
    await etcd.connect()
    keys = Keys(cluster_name)
    lease = LeaseKeeper(etcd, ttl_s=30)
    await lease.grant()
    fence = cpb.Fence(epoch=await LeaderElection(etcd, keys.leader(), "sched", lease).campaign())
    target = getattr(S, f"CELL_STATE_{dies_entering}")
    try:
        if dies_entering == "TRAINING":
            await _set(proc.target, fence, S.CELL_STATE_DRAINING)
        armed.write_text(f"cell.state.{dies_entering.lower()}\n")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _set(proc.target, fence, target)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(proc.wait, 20) == EXIT_STATUS
        assert await _state(etcd, keys) == dies_entering  # written, never acted on
        armed.unlink()
        await asyncio.to_thread(proc.start, 60)  # the supervisor's restart
        assert await _state(etcd, keys) == "ROLLOUT"  # the new incarnation says where it is
        if dies_entering == "DRAINING":
            assert (await _set(proc.target, fence, target)).state == target  # the retry is obeyed
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _set(proc.target, fence, target)  # not from ROLLOUT: the scheduler decides again
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            for state in (S.CELL_STATE_DRAINING, S.CELL_STATE_TRAINING):
                await _set(proc.target, fence, state)
        assert await _state(etcd, keys) == dies_entering
        verdict = check_files([hist])
        assert verdict.ok, verdict.violations
        assert verdict.counts["cell_starts"] == 2
    finally:
        armed.unlink(missing_ok=True)
        await asyncio.to_thread(proc.stop)
        await lease.revoke()
        await etcd.close()
