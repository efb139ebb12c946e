"""The disk under the packer's WAL fills up while records arrive and a batch trains: the
packer stays up and holds every write (callers time out and retry: every call is
idempotent) until space returns; with room for the log's appends but not for a new log, a
compaction finds no room and keeps the old log; once space is back the run goes on and the
log is compacted. Every turn is trained exactly once, nothing acknowledged is lost, the
packer never restarts, the WAL left behind is intact (whole checksummed lines, no
half-written compaction beside it), and the packer's history checks clean.

The disk fills two ways (one test, parametrized): failpoints that make the WAL's writes and
the compaction's writes raise ENOSPC, and a real filesystem, a small tmpfs mounted under the
WAL (root only; skipped where mount is refused) that a filler file fills up, then frees one
page of, then deletes. The history file and the logs stay off the full disk."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from apps.checker import check_files
from apps.procs import ServiceProcess
from gyre.failpoints import FAILPOINT_FILE_ENV
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.servicer import PackerServicer
from services.packer.wal import WAL_NAME
from testkit import packer_kit as tk
from testkit.tls import RoleStubs

pytestmark = pytest.mark.timeout(120)
CLAIMED = packer_pb2.CLAIM_OUTCOME_CLAIMED
CLOSED = packer_pb2.CLAIM_OUTCOME_CLOSED
DISK_FULL_LOG = "the disk under the WAL is full"
NO_ROOM_TO_COMPACT_LOG = "no space to compact the WAL; keeping the log"
TMPFS_SIZE = "512k"
PAGE = os.sysconf("SC_PAGESIZE")


class FailpointDisk:
    """A full disk faked by failpoints: the WAL's writes and the compaction's raise ENOSPC."""

    def __init__(self, root: Path) -> None:
        self.wal_dir = root / "wal"
        self.armed = root / "failpoints"
        self.env = {FAILPOINT_FILE_ENV: str(self.armed)}

    def fill(self) -> None:
        self.armed.write_text("packer.wal.write=enospc\npacker.wal.compact=enospc\n")

    def free_some(self) -> None:
        """Room for the log's appends, none for a compaction's new log."""
        self.armed.write_text("packer.wal.compact=enospc\n")

    def free(self) -> None:
        self.armed.unlink(missing_ok=True)


class TmpfsDisk:
    """A real full disk: a tmpfs of TMPFS_SIZE under the WAL, filled by a filler file."""

    def __init__(self, mountpoint: Path) -> None:
        self.wal_dir = mountpoint / "wal"
        self.filler = mountpoint / "filler"
        self.env: dict[str, str] = {}
        self.filled_bytes = 0

    def fill(self) -> None:
        """Appends to the filler until the filesystem says ENOSPC (again: space a
        compaction gave back is taken too)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            chunk = b"\0" * 65536
            while True:
                try:
                    self.filled_bytes += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    return
        finally:
            os.close(fd)

    def free_some(self) -> None:
        """One page back: the stalled append takes it, and the log's last page then holds a
        few more appends while a compaction's new log finds no free page."""
        os.truncate(self.filler, self.filled_bytes - PAGE)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture(params=["failpoint", "tmpfs"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FailpointDisk | TmpfsDisk]:
    if request.param == "failpoint":
        yield FailpointDisk(tmp_path)
        return
    if PAGE != 4096:
        pytest.skip(f"the feed fills a 4 KiB tmpfs page, not one of {PAGE} bytes")
    mountpoint = tmp_path / "fs"
    mountpoint.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs for a real full disk: {exc!r}")
    if done.returncode != 0:
        pytest.skip(
            "cannot mount a tmpfs for a real full disk (needs root or CAP_SYS_ADMIN): "
            + (done.stderr.strip() or f"mount exited {done.returncode}")
        )
    try:
        yield TmpfsDisk(mountpoint)
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


async def _retrying(stub, method: str, request, stalled: list[str]):
    """One packer call until it answers (a stalled write times out: try again)."""
    while True:
        try:
            return await getattr(stub, method)(request, timeout=1.0)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            stalled.append(method)


async def _logged(plog: Path, message: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if message in plog.read_text():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the packer never logged {message!r}")


def _assert_intact(wal_dir: Path, settled: bool = True) -> None:
    """Every line of the WAL checks (a write resumed after ENOSPC went on from the byte where
    it stopped); once ``settled``, no line is torn and no compaction was left half-done
    beside the log (unsettled, the last line may be an append still being written)."""
    data = (wal_dir / WAL_NAME).read_bytes()
    assert data.endswith(b"\n") or not settled, "a torn last line"
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        crc, _, body = line.partition(b" ")
        assert len(crc) == 8 and int(crc, 16) == zlib.crc32(body), f"WAL line {n} is damaged"
    if settled:
        assert sorted(p.name for p in wal_dir.iterdir()) == [WAL_NAME]


async def test_disk_full_under_the_wal_holds_writes_and_loses_nothing(
    tmp_path, etcd_server, cluster_name, disk
):
    hist = tmp_path / "packer.jsonl"
    plog = tmp_path / "packer.log"
    path = tk.write_config(
        tmp_path,
        etcd_server,
        cluster_name,
        wal_dir=str(disk.wal_dir),
        batch_size=6,
        claim_ttl_s=20.0,
        wal_compact_bytes=4096,
        wal_compact_check_s=0.05,
        history_file=str(hist),
    )
    proc = ServiceProcess("packer", path, env=disk.env, log_path=plog)
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
            # Fill the disk (and keep it full) until a write waits for space and its caller timed out.
            while not (stalled and DISK_FULL_LOG in plog.read_text()):
                assert not feeding.done(), "every write went through a full disk"
                await asyncio.to_thread(disk.fill)
                await asyncio.sleep(0.05)
            held_at = sent
            disk.free_some()  # the writes go on; a compaction finds no room and keeps the log
            await _logged(plog, NO_ROOM_TO_COMPACT_LOG)
            assert not (disk.wal_dir / (WAL_NAME + ".compact")).exists()
            _assert_intact(disk.wal_dir, settled=False)  # the old log, with the held write
            disk.free()  # space again
            await feeding
            assert sent == 36 and held_at < 36

            trained = []
            while True:
                r = await _retrying(
                    stub,
                    "ClaimMicroSteps",
                    packer_pb2.ClaimMicroStepsRequest(
                        cell_id="worker", batch_id=1, wait_s=0.5, max_micro_steps=1
                    ),
                    stalled,
                )
                if r.outcome == CLOSED:
                    break
                if r.outcome != CLAIMED:
                    continue
                (ms,) = r.micro_steps
                trained += [(s.execution_id, s.turn_index) for s in ms.sequences]
                ack = packer_pb2.AckMicroStepsRequest(
                    cell_id="worker", batch_id=1, micro_step_ids=[ms.micro_step_id]
                )
                await _retrying(stub, "AckMicroSteps", ack, stalled)
            status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
            assert status.done
            assert len(trained) == len(set(trained)) == 36  # every turn once: none lost, none twice
            assert status.counters.produced == status.counters.consumed == 36
        assert proc.alive() and proc.pid == pid  # it never went down
        # The log is compacted again now that there is room (and no compaction is in flight).
        for _ in range(200):
            compacting = (disk.wal_dir / (WAL_NAME + ".compact")).exists()
            if b'"t":"snapshot"' in (disk.wal_dir / WAL_NAME).read_bytes() and not compacting:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the WAL was never compacted once space returned")
        _assert_intact(disk.wal_dir)
        verdict = check_files([hist])
        assert verdict.ok, verdict.violations
        assert verdict.counts["finishes"] == 12 and verdict.counts["acks"] == verdict.counts["micro_steps"]
    finally:
        disk.free()
        proc.kill()
