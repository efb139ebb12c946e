"""Packer faults with real processes: a packer SIGKILLed mid-batch (while records are
arriving and a claim is held) and restarted from its WAL loses no trajectory and packs none
twice, and every turn is trained exactly once; a claimer process SIGKILLed between claim and
ack has its micro-step returned after the claim TTL, and it is trained once by another
cell."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

from apps.procs import ROOT, ServiceProcess
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.servicer import PackerServicer
from testkit import packer_kit as tk
from testkit.packer_process import CLAIMED, CLOSED, Reconnecting, SixGroups, worked
from testkit.tls import RoleStubs


def _claim(cell_id: str, wait_s: float = 0.0) -> packer_pb2.ClaimMicroStepsRequest:
    """A claim of one micro-step of batch 1."""
    return packer_pb2.ClaimMicroStepsRequest(cell_id=cell_id, batch_id=1, wait_s=wait_s, max_micro_steps=1)


def _ack(cell_id: str, micro_step_id: str) -> packer_pb2.AckMicroStepsRequest:
    """The ack of one micro-step of batch 1."""
    return packer_pb2.AckMicroStepsRequest(cell_id=cell_id, batch_id=1, micro_step_ids=[micro_step_id])


async def test_packer_killed_mid_batch_loses_nothing(tmp_path, etcd_server, cluster_name):
    # A tiny compaction threshold: the log is rewritten to snapshots while records arrive,
    # so the SIGKILL may land during a compaction too.
    path = tk.write_config(
        tmp_path,
        etcd_server,
        cluster_name,
        batch_size=6,
        claim_ttl_s=20.0,
        wal_compact_bytes=4096,
        wal_compact_check_s=0.02,
    )
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    client = Reconnecting(proc)
    feeder = SixGroups(client)
    try:
        feeding = asyncio.create_task(feeder.run())
        await feeder.until(12, poll_s=0.01)
        r = await client.call("ClaimMicroSteps", _claim("holder", wait_s=5.0))
        assert r.outcome == CLAIMED
        (held,) = r.micro_steps
        await feeder.until(20)
        proc.kill()  # SIGKILL mid-batch, records in flight
        killed_at = feeder.sent
        proc.target = ""
        proc2 = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
        proc.target = proc2.target  # the client follows
        await feeding
        assert feeder.sent == 36 and killed_at < 36

        trained = [(s.execution_id, s.turn_index) for s in held.sequences]
        seen_ids = set()
        async for ms in worked(client):
            assert ms.micro_step_id != held.micro_step_id  # held across restart
            assert ms.micro_step_id not in seen_ids
            seen_ids.add(ms.micro_step_id)
            trained += [(s.execution_id, s.turn_index) for s in ms.sequences]
        ack = await client.call("AckMicroSteps", _ack("holder", held.micro_step_id))
        assert list(ack.duplicate) == [False]
        status = await client.call("GetBatch", packer_pb2.GetBatchRequest(batch_id=1))
        assert status.done
        assert len(trained) == len(set(trained)) == 36  # every turn once: none lost, none twice
        c = status.counters
        assert c.produced == c.consumed == 36 and c.buffered == 0
        proc2.kill()
        lines = (tmp_path / "wal" / "packer.wal").read_text().splitlines()
        assert '"t":"snapshot"' in lines[1]  # it was compacted at least once
    finally:
        await client.close()
        proc.kill()


CLAIMER = """
import asyncio, sys, grpc
from gyre.v1 import packer_pb2, packer_pb2_grpc
from testkit.tls import channel
async def main():
    async with channel(sys.argv[1], "doomed") as ch:
        stub = packer_pb2_grpc.PackerStub(ch)
        r = await stub.ClaimMicroSteps(packer_pb2.ClaimMicroStepsRequest(
            cell_id="doomed", batch_id=1, wait_s=5.0, max_micro_steps=1), timeout=10)
        print(r.micro_steps[0].micro_step_id, flush=True)
        await asyncio.sleep(3600)  # "training", never acks
asyncio.run(main())
"""


async def test_claimer_killed_between_claim_and_ack(tmp_path, etcd_server, cluster_name):
    path = tk.write_config(
        tmp_path, etcd_server, cluster_name, batch_size=2, claim_ttl_s=1.5, micro_step_token_budget=16
    )
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    claimer = None
    keeper: asyncio.Task[None] | None = None
    try:
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            for g in range(2):
                for k in range(2):
                    await stub.RecordTurn(tk.turn_proto(f"g{g}-x{k}", f"g{g}", 0), timeout=5)
                    await stub.ReportFinish(tk.finish_proto(f"g{g}-x{k}", f"g{g}", 2, reward=k), timeout=5)
            # The core takes the first micro-step (it is a participant of the batch).
            r = await stub.ClaimMicroSteps(_claim("core", wait_s=1.0), timeout=5)
            assert r.outcome == CLAIMED
            (first,) = r.micro_steps
            # A real core keeps its claims alive while it trains; the claimer's start-up can
            # outlast the claim TTL on a loaded machine (the core's claim expired too: 2).
            keeper = asyncio.create_task(_keep_claims(stub, "core", every_s=0.2))
            claimer = subprocess.Popen(
                [sys.executable, "-c", CLAIMER, proc.target],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            doomed_id = (await asyncio.to_thread(claimer.stdout.readline)).strip()  # the loop keeps claims
            assert doomed_id and doomed_id != first.micro_step_id
            claimer.send_signal(signal.SIGKILL)
            await asyncio.to_thread(claimer.wait)
            trained = {first.micro_step_id}
            await stub.AckMicroSteps(_ack("core", first.micro_step_id), timeout=5)
            killed = time.monotonic()
            while True:
                r = await stub.ClaimMicroSteps(_claim("core", wait_s=0.5), timeout=5)
                if r.outcome == CLAIMED:
                    break
                # Newcomers are refused once the window is closed; the core waits for the return.
                late = await stub.ClaimMicroSteps(_claim("newcomer"), timeout=5)
                assert late.outcome == CLOSED
                assert time.monotonic() - killed < 20, "claim never returned"
            assert [ms.micro_step_id for ms in r.micro_steps] == [doomed_id]
            assert doomed_id not in trained
            await stub.AckMicroSteps(_ack("core", doomed_id), timeout=5)
            status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
            assert status.done and status.acked == status.micro_steps == 2
            assert status.counters.claims_expired == 1
            assert status.counters.consumed == status.counters.produced == 4
    finally:
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        if claimer is not None and claimer.poll() is None:
            claimer.kill()
        proc.kill()


async def _keep_claims(stub, cell_id: str, every_s: float) -> None:
    """What a training cell does while it holds claims: keeps them alive."""
    while True:
        await stub.KeepClaims(packer_pb2.KeepClaimsRequest(cell_id=cell_id), timeout=5)
        await asyncio.sleep(every_s)


async def test_claims_of_a_cell_whose_registration_vanishes_return_at_once(
    tmp_path, etcd_server, cluster_name
):
    from gyre.etcd import Etcd, Keys

    # A claim TTL far longer than the test: only the registration can bring the claim back.
    path = tk.write_config(
        tmp_path, etcd_server, cluster_name, batch_size=1, claim_ttl_s=300.0, micro_step_token_budget=8
    )
    proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    try:
        lease = await etcd.grant(60)
        await etcd.put(Keys(cluster_name).cell("cell-9"), b'{"cell_id": "cell-9"}', lease=lease)
        async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            for k in range(2):
                await stub.RecordTurn(tk.turn_proto(f"x{k}", "g", 0), timeout=5)
                await stub.ReportFinish(tk.finish_proto(f"x{k}", "g", 2, reward=k), timeout=5)
            core = await stub.ClaimMicroSteps(_claim("core"), timeout=5)
            lost = await stub.ClaimMicroSteps(_claim("cell-9"), timeout=5)
            assert core.outcome == lost.outcome == CLAIMED
            await asyncio.sleep(0.5)  # the packer's mirror has seen cell-9 registered
            await etcd.revoke(lease)  # cell-9's process died: etcd drops its registration
            deadline = time.monotonic() + 15
            while True:
                r = await stub.ClaimMicroSteps(_claim("core", wait_s=0.5), timeout=5)
                if r.outcome == CLAIMED:
                    break
                assert time.monotonic() < deadline, "claim of the vanished cell never returned"
            assert [ms.micro_step_id for ms in r.micro_steps] == [lost.micro_steps[0].micro_step_id]
            for got in (core, r):
                await stub.AckMicroSteps(_ack("core", got.micro_steps[0].micro_step_id), timeout=5)
            status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
            assert status.done and status.counters.consumed == 2
    finally:
        await etcd.close()
        proc.kill()
