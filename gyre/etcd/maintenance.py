"""etcd upkeep: defragment the member when compaction has left most of its file free.

etcd's auto-compaction (``--auto-compaction-retention``) drops old revisions, which frees
pages inside the database file for reuse but never shrinks the file. Defragmentation
rewrites the file without the free pages; it blocks the member's reads and writes while it
runs (milliseconds for the few megabytes Gyre keeps), so it runs only when the free part is
worth it: at least ``min_free_mb`` and at least ``min_free_share`` of the file. The rule is
the one the etcd operators' ``etcd-defrag`` tool applies (free space above a size, or a
share of the quota), sized for Gyre's small database.

Defragmentation needs etcd's root role: the local launcher runs it with the root identity
(:mod:`apps.launch`); elsewhere an operator runs ``python -m gyre.etcd.maintenance`` with
the root certificate, for example from a Kubernetes CronJob.

    python -m gyre.etcd.maintenance --endpoint https://127.0.0.1:23790 --tls-dir CERTS/root
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aetcd.rpc

if TYPE_CHECKING:
    from gyre.etcd.client import Etcd

log = logging.getLogger(__name__)

MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class DefragRule:
    """When a member's database file is worth defragmenting."""

    min_free_mb: float = 32.0
    min_free_share: float = 0.5

    def __post_init__(self) -> None:
        if self.min_free_mb < 0 or not 0.0 <= self.min_free_share <= 1.0:
            raise ValueError(f"min_free_mb >= 0 and 0 <= min_free_share <= 1, got {self}")

    def due(self, size: DbSize) -> bool:
        return (
            size.free_bytes >= self.min_free_mb * MB
            and size.free_bytes >= self.min_free_share * size.file_bytes
        )


@dataclasses.dataclass(frozen=True)
class DbSize:
    """The member's database file and the part of it in use."""

    file_bytes: int
    in_use_bytes: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.file_bytes - self.in_use_bytes)


@dataclasses.dataclass(frozen=True)
class DefragOutcome:
    before: DbSize
    after: DbSize
    seconds: float


async def db_size(etcd: Etcd) -> DbSize:
    """The responding member's database size (``dbSize``) and size in use (``dbSizeInUse``),
    which aetcd's ``status()`` does not return."""
    client = etcd.client
    response = await client.maintenancestub.Status(
        aetcd.rpc.StatusRequest(), timeout=etcd.timeout_s, metadata=client.metadata
    )
    return DbSize(file_bytes=int(response.dbSize), in_use_bytes=int(response.dbSizeInUse))


async def defragment_if_due(etcd: Etcd, rule: DefragRule, timeout_s: float = 60.0) -> DefragOutcome | None:
    """Defragments the responding member when ``rule`` says its free part is worth it;
    returns the sizes before and after, or None when it was not due."""
    before = await db_size(etcd)
    if not rule.due(before):
        return None
    client = etcd.client
    loop = asyncio.get_running_loop()
    started = loop.time()
    await client.maintenancestub.Defragment(
        aetcd.rpc.DefragmentRequest(), timeout=timeout_s, metadata=client.metadata
    )
    seconds = loop.time() - started
    after = await db_size(etcd)
    log.info(
        "etcd defragmented",
        extra={
            "db_mb_before": round(before.file_bytes / MB, 2),
            "db_mb_after": round(after.file_bytes / MB, 2),
            "in_use_mb": round(after.in_use_bytes / MB, 2),
            "seconds": round(seconds, 3),
        },
    )
    return DefragOutcome(before, after, seconds)


def main(argv: Sequence[str] | None = None) -> int:
    from gyre.etcd.client import Etcd
    from gyre.grpcx.tls import TlsFiles

    parser = argparse.ArgumentParser(
        prog="python -m gyre.etcd.maintenance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--endpoint", required=True, help="https://host:port of the member")
    parser.add_argument("--tls-dir", required=True, help="identity directory of the root user (CN root)")
    parser.add_argument("--min-free-mb", type=float, default=DefragRule.min_free_mb)
    parser.add_argument("--min-free-share", type=float, default=DefragRule.min_free_share)
    parser.add_argument("--force", action="store_true", help="defragment whatever the free part")
    args = parser.parse_args(argv)
    rule = DefragRule(0.0, 0.0) if args.force else DefragRule(args.min_free_mb, args.min_free_share)

    async def run() -> DefragOutcome | None:
        async with Etcd([args.endpoint], timeout_s=10.0, tls=TlsFiles.from_dir(args.tls_dir)) as etcd:
            return await defragment_if_due(etcd, rule)

    outcome = asyncio.run(run())
    if outcome is None:
        print("not due")
    else:
        print(
            f"defragmented in {outcome.seconds:.3f} s: {outcome.before.file_bytes / MB:.1f} -> "
            f"{outcome.after.file_bytes / MB:.1f} MB ({outcome.after.in_use_bytes / MB:.1f} MB in use)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
