"""The disk under the packer's WAL fills up while records arrive and a batch trains: the
packer stays up and holds every write (callers time out and retry: every call is
idempotent) until space returns, a compaction that finds no room keeps the old log; then
the run goes on. Every turn is trained exactly once, nothing acknowledged is lost, and the
packer's history checks clean."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from apps.checker import check_files
from apps.procs import ServiceProcess
from gyre.failpoints import FAILPOINT_FILE_ENV
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.servicer import PackerServicer
from tests.support import packer_kit as tk
from tests.tls import RoleStubs

pytestmark = pytest.mark.timeout(120)
CLAIMED = packer_pb2.CLAIM_OUTCOME_CLAIMED
CLOSED = packer_pb2.CLAIM_OUTCOME_CLOSED


async def _retrying(stub, method: str, request, stalled: list[str]):
    """One packer call until it answers (a stalled write times out: try again)."""
    while True:
        try:
            return await getattr(stub, method)(request, timeout=1.0)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            stalled.append(method)


async def test_disk_full_under_the_wal_holds_writes_and_loses_nothing(tmp_path, etcd_server, cluster_name):
    hist = tmp_path / "packer.jsonl"
    armed = tmp_path / "failpoints"
    path = tk.write_config(
        tmp_path,
        etcd_server,
        cluster_name,
        batch_size=6,
        claim_ttl_s=20.0,
        wal_compact_bytes=4096,
        wal_compact_check_s=0.05,
        history_file=str(hist),
    )
    proc = ServiceProcess(
        "packer", path, env={FAILPOINT_FILE_ENV: str(armed)}, log_path=tmp_path / "packer.log"
    )
    await asyncio.to_thread(proc.start)
    pid = proc.pid
    stalled: list[str] = []
    sent = 0
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:

            async def feeder():
                nonlocal sent
                for g in range(6):
                    for k in range(2):
                        x = f"g{g}-x{k}"
                        for i in range(3):
                            turn = tk.turn_proto(x, f"g{g}", i, prompt=5, output=3 + k)
                            await _retrying(stub, "RecordTurn", turn, stalled)
                            sent += 1
                        finish = tk.finish_proto(x, f"g{g}", 2, reward=float(k))
                        await _retrying(stub, "ReportFinish", finish, stalled)

            feeding = asyncio.create_task(feeder())
            while sent < 12:
                await asyncio.sleep(0.01)
            armed.write_text("packer.wal.write=enospc\npacker.wal.compact=enospc\n")  # the disk is full
            while not stalled:  # a write waits for space; its caller timed out
                assert not feeding.done(), "every write went through a full disk"
                await asyncio.sleep(0.05)
            held_at = sent
            armed.unlink()  # space again
            await feeding
            assert sent == 36 and held_at < 36

            trained = []
            while True:
                r = await _retrying(
                    stub,
                    "ClaimMicroStep",
                    packer_pb2.ClaimMicroStepRequest(cell_id="worker", batch_id=1, wait_s=0.5),
                    stalled,
                )
                if r.outcome == CLOSED:
                    break
                if r.outcome != CLAIMED:
                    continue
                trained += [(s.execution_id, s.turn_index) for s in r.micro_step.sequences]
                ack = packer_pb2.AckMicroStepRequest(
                    cell_id="worker", batch_id=1, micro_step_id=r.micro_step.micro_step_id
                )
                await _retrying(stub, "AckMicroStep", ack, stalled)
            status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
            assert status.done
            assert len(trained) == len(set(trained)) == 36  # every turn once: none lost, none twice
            assert status.counters.produced == status.counters.consumed == 36
        assert proc.alive() and proc.pid == pid  # it never went down
        assert "the disk under the WAL is full" in (tmp_path / "packer.log").read_text()
        verdict = check_files([hist])
        assert verdict.ok, verdict.violations
        assert verdict.counts["finishes"] == 12 and verdict.counts["acks"] == verdict.counts["micro_steps"]
    finally:
        armed.unlink(missing_ok=True)
        proc.kill()
