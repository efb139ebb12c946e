"""The packer as a real process over real gRPC and a real etcd: 16 claimers racing over the
network each get disjoint micro-steps and every turn is trained exactly once; malformed and
oversized records get precise statuses (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND,
FAILED_PRECONDITION) and change no counter; batched claims (retried with their claim_id)
and batched acks train every micro-step exactly once too; the policy version follows etcd's policy key;
WatchSupply streams the supply as groups become ready."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.identity import Role
from gyre.v1 import common_pb2, packer_pb2, packer_pb2_grpc
from services.cell_agent.training.microstep import Outcome
from services.cell_agent.training.packer_client import PackerSource
from services.packer.servicer import PackerServicer
from testkit import packer_kit as tk
from testkit.packer_process import CLAIMED, CLOSED
from testkit.tls import RoleStubs, channel


async def drain(stub, cell, batch_id, trained, wait_s=0.5):
    """Claims one micro-step per ClaimMicroSteps call and acks it alone (AckMicroSteps of one)."""
    mine = []
    while True:
        r = await stub.ClaimMicroSteps(
            packer_pb2.ClaimMicroStepsRequest(
                cell_id=cell, batch_id=batch_id, policy_version=0, wait_s=wait_s, max_micro_steps=1
            ),
            timeout=10,
        )
        if r.outcome == CLOSED:
            return mine
        if r.outcome != CLAIMED:
            continue
        (ms,) = r.micro_steps
        mine.append(ms.micro_step_id)
        trained.extend((s.execution_id, s.turn_index) for s in ms.sequences)
        await asyncio.sleep(random.random() * 0.01)
        ack = await stub.AckMicroSteps(
            packer_pb2.AckMicroStepsRequest(
                cell_id=cell, batch_id=batch_id, micro_step_ids=[ms.micro_step_id]
            ),
            timeout=10,
        )
        assert list(ack.duplicate) == [False]


@contextlib.asynccontextmanager
async def _four_stubs(target: str) -> AsyncIterator[list[RoleStubs]]:
    """Four packer stubs on ``target`` (closed on the way out)."""
    stubs = [RoleStubs(target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) for _ in range(4)]
    try:
        yield stubs
    finally:
        for stub in stubs:
            await stub.close()


async def _feed_and_drain(
    stubs: list[RoleStubs], drains: list[Coroutine[Any, Any, list[str]]]
) -> tuple[list[list[str]], list[str], packer_pb2.BatchStatus]:
    """Eight groups fed through the first stub while ``drains`` claim batch 1: the micro-steps
    of each drain, all of them, and the batch's status once every drain is done."""
    results = await asyncio.gather(tk.feed_stub(stubs[0], 8), *drains)
    drained: list[list[str]] = list(results[1:])
    status = await stubs[0].GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
    return drained, [m for ids in drained for m in ids], status


async def test_sixteen_claimers_race_over_grpc(packer_proc):
    async with _four_stubs(packer_proc(batch_size=8).target) as stubs:
        trained: list[tuple[str, int]] = []
        _, claimed, status = await _feed_and_drain(
            stubs, [drain(stubs[i % 4], f"cell{i}", 1, trained) for i in range(16)]
        )
        assert status.done and status.sealed and status.closed
        assert len(claimed) == len(set(claimed)) == status.micro_steps == status.acked
        assert len(trained) == len(set(trained)) == 8 * 3 * 2
        c = status.counters
        assert c.produced == c.consumed == 48 and c.buffered == 0


async def drain_batched(stub, cell, batch_id, trained, n):
    """Claims up to ``n`` micro-steps per ClaimMicroSteps call (retrying each call once with
    its claim_id, as a client whose answer was lost would) and acks them with AckMicroSteps."""
    mine = []
    while True:
        req = packer_pb2.ClaimMicroStepsRequest(
            cell_id=cell, batch_id=batch_id, wait_s=0.5, claim_id=f"{cell}-{len(mine)}", max_micro_steps=n
        )
        r = await stub.ClaimMicroSteps(req, timeout=10)
        if r.outcome == CLOSED:
            return mine
        if r.outcome != CLAIMED:
            continue
        retry = await stub.ClaimMicroSteps(req, timeout=10)  # idempotent: the same micro-steps
        ids = [m.micro_step_id for m in r.micro_steps]
        assert [m.micro_step_id for m in retry.micro_steps][: len(ids)] == ids
        ids = [m.micro_step_id for m in retry.micro_steps]
        mine.extend(ids)
        trained.extend((s.execution_id, s.turn_index) for m in retry.micro_steps for s in m.sequences)
        await asyncio.sleep(random.random() * 0.01)
        ack = await stub.AckMicroSteps(
            packer_pb2.AckMicroStepsRequest(cell_id=cell, batch_id=batch_id, micro_step_ids=ids), timeout=10
        )
        assert list(ack.duplicate) == [False] * len(ids)
        again = await stub.AckMicroSteps(
            packer_pb2.AckMicroStepsRequest(cell_id=cell, batch_id=batch_id, micro_step_ids=ids), timeout=10
        )
        assert list(again.duplicate) == [True] * len(ids)


async def test_batched_claims_and_acks_over_grpc(packer_proc):
    async with _four_stubs(packer_proc(batch_size=8).target) as stubs:
        trained: list[tuple[str, int]] = []
        drained, claimed, status = await _feed_and_drain(
            stubs, [drain_batched(stubs[i % 4], f"cell{i}", 1, trained, 1 + i % 4) for i in range(8)]
        )
        assert status.done and len(claimed) == len(set(claimed)) == status.micro_steps == status.acked
        assert len(trained) == len(set(trained)) == 8 * 3 * 2
        bad = packer_pb2.ClaimMicroStepsRequest(cell_id="cell0", batch_id=0, max_micro_steps=0)
        assert await _code(stubs[0].ClaimMicroSteps(bad, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        # A cell's own micro-step with an unknown one (any cell that trained one: cell 0,
        # claiming one at a time against cells claiming up to 4, may have trained none).
        owner, mine = next((i, ids) for i, ids in enumerate(drained) if ids)
        unknown = packer_pb2.AckMicroStepsRequest(
            cell_id=f"cell{owner}", batch_id=1, micro_step_ids=[mine[0], "nope"]
        )
        assert await _code(stubs[0].AckMicroSteps(unknown, timeout=5)) == grpc.StatusCode.NOT_FOUND
        theirs = next(ids for ids in drained[1:] if ids)  # trained by another cell
        other = packer_pb2.AckMicroStepsRequest(cell_id="cell0", batch_id=1, micro_step_ids=theirs[:1])
        assert await _code(stubs[0].AckMicroSteps(other, timeout=5)) == grpc.StatusCode.FAILED_PRECONDITION


async def test_the_trainers_packer_client_claims_and_acks_in_batches(packer_proc):
    proc = packer_proc(batch_size=2)
    ch = channel(proc.target, "cell7", Role.CELL_AGENT)
    source = PackerSource(proc.target, "cell7", channel=ch)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    try:
        await tk.feed_stub(stub, 2, size=3, turns=2)
        claims = await source.claim_many(1, 0, 1.0, 64, "k")
        assert all(c.outcome is Outcome.CLAIMED for c in claims) and claims
        ids = [c.micro_step.micro_step_id for c in claims]
        retry = [c.micro_step.micro_step_id for c in await source.claim_many(1, 0, 0.0, 64, "k")]
        assert retry[: len(ids)] == ids  # the same claim (topped up if more were packed since)
        while True:
            assert await source.ack_many(1, retry) == [False] * len(retry)
            assert await source.ack_many(1, retry) == [True] * len(retry)
            more = await source.claim_many(1, 0, 0.5, 4)
            if more[0].outcome is Outcome.CLOSED:
                break
            retry = [c.micro_step.micro_step_id for c in more if c.micro_step is not None]
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.done and status.acked == status.micro_steps
    finally:
        await stub.close()
        await source.close()
        await ch.close()


async def _code(call):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


async def test_malformed_records_get_precise_statuses_and_change_nothing(packer_proc):
    proc = packer_proc()
    async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
        await tk.feed_stub(stub, 1, size=2, turns=1)
        before = (await stub.GetBatch(packer_pb2.GetBatchRequest(), timeout=5)).counters

        bad_len = tk.turn_proto("x1", "g9", 0)
        del bad_len.output_logprobs[-1]
        assert await _code(stub.RecordTurn(bad_len, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        nan_lp = tk.turn_proto("x1", "g9", 0)
        nan_lp.output_logprobs[0] = float("nan")
        assert await _code(stub.RecordTurn(nan_lp, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        nan_reward = tk.finish_proto("x1", "g9", 2, reward=float("nan"))
        assert await _code(stub.ReportFinish(nan_reward, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        running = tk.finish_proto("x1", "g9", 2)
        running.status = common_pb2.EXECUTION_STATUS_RUNNING
        assert await _code(stub.ReportFinish(running, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        too_long = tk.turn_proto("x1", "g9", 0, prompt=60)  # budget is 48 tokens
        assert await _code(stub.RecordTurn(too_long, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        huge = tk.turn_proto("x1", "g9", 0, prompt=300_000)  # past max_message_bytes (1 MiB)
        assert await _code(stub.RecordTurn(huge, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        unknown = packer_pb2.AckMicroStepsRequest(cell_id="c", batch_id=1, micro_step_ids=["nope"])
        assert await _code(stub.AckMicroSteps(unknown, timeout=5)) == grpc.StatusCode.NOT_FOUND
        late = tk.turn_proto("g0-x0", "g0", 7)
        assert await _code(stub.RecordTurn(late, timeout=5)) == grpc.StatusCode.FAILED_PRECONDITION
        # A cell claims only for itself.
        no_cell = packer_pb2.ClaimMicroStepsRequest(batch_id=0, max_micro_steps=1)
        assert (
            await _code(stub.as_("cell-0").ClaimMicroSteps(no_cell, timeout=5))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert (
            await _code(stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=99), timeout=5))
            == grpc.StatusCode.NOT_FOUND
        )
        stale_seal = packer_pb2.SealBatchRequest(batch_id=0)
        assert await _code(stub.SealBatch(stale_seal, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT

        after = (await stub.GetBatch(packer_pb2.GetBatchRequest(), timeout=5)).counters
        assert after.late_turns == 1  # the late turn is counted, outside the conservation sum
        after.late_turns = 0
        assert after == before
        # The service is healthy for everyone else.
        assert not (await stub.RecordTurn(tk.turn_proto("x1", "g9", 0), timeout=5)).duplicate


async def test_policy_version_follows_etcd_and_supply_streams(packer_proc, etcd_server, cluster_name):
    proc = packer_proc(batch_size=2)
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            stream = stub.WatchSupply(packer_pb2.WatchSupplyRequest())
            first = await asyncio.wait_for(stream.read(), 5)
            assert first.batch_id == 1 and first.batch_needs == 2 and first.ready_groups == 0
            await tk.feed_stub(stub, 1, size=2, turns=1)
            while True:
                sig = await asyncio.wait_for(stream.read(), 5)
                if sig.ready_groups == 1:
                    break
            assert sig.counters.ready == 2
            await etcd.put(
                Keys(cluster_name).policy(), json.dumps({"version": 4, "source_target": ""}).encode()
            )
            # Version 4 makes the version-0 group stale (max_staleness 1): dropped, streamed.
            while True:
                sig = await asyncio.wait_for(stream.read(), 5)
                if sig.counters.policy_version == 4:
                    break
            assert sig.ready_groups == 0 and sig.dropped["stale"] == 2
            # Not cancelled by the scheduler: it leaves the dispatch gate and is replaced.
            assert sig.groups_filtered == 1
            stream.cancel()
    finally:
        await etcd.close()


async def test_wal_is_replayed_in_the_same_cluster_and_archived_for_a_new_one(
    tmp_path, etcd_server, fresh_etcd, cluster_name
):
    import urllib.request

    from gyre.ports import free_port

    port = free_port()
    path = tk.write_config(tmp_path, etcd_server, cluster_name, metrics_port=port)
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            await tk.feed_stub(stub, 1, size=2, turns=2)
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        )
        assert b'gyre_packer_turns{where="produced"} 4.0' in body
    finally:
        proc.stop()
    # Same cluster (same etcd): the WAL is replayed.
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            got = await stub.GetBatch(packer_pb2.GetBatchRequest(), timeout=5)
            assert got.counters.produced == 4 and got.counters.ready == 4
    finally:
        proc.stop()
    # A new cluster (a fresh etcd, e.g. the next demo run): the old WAL is archived.
    path = tk.write_config(tmp_path, fresh_etcd, cluster_name)
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            got = await stub.GetBatch(packer_pb2.GetBatchRequest(), timeout=5)
            assert got.counters.produced == 0 and got.batch_id == 1
    finally:
        proc.stop()
    assert len(list((tmp_path / "wal").glob("packer.wal.*.old"))) == 1


async def test_the_packers_log_is_read_through_its_api_by_an_operator_only(packer_proc, tmp_path):
    """Packer.ReadLog answers an operator the events of the packer's durable log, the same as
    its WAL file holds (the demo audits a run through it, with no access to the packer's
    disk); a router is refused."""
    from apps.demo.trajectories import analyze, read_events, read_log
    from testkit.tls import tls

    proc = packer_proc()
    async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
        await tk.feed_stub(stub, 2, size=2, turns=2)
    events = await read_log(proc.target, tls("operator"))
    assert events == read_events(tmp_path / "wal")
    assert {"turn", "finish"} <= {e["t"] for e in events}
    assert analyze(events)["executions"] == 4
    with pytest.raises(grpc.RpcError) as refused:
        await read_log(proc.target, tls("router", Role.ROUTER))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
