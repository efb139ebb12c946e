"""The trainer's etcd adapter: publishing a new policy version at ``keys.policy()``."""

from __future__ import annotations

import logging
from typing import Any

from gyre.etcd import Etcd, Keys
from gyre.etcd.client import Op, mod_revision_is
from gyre.etcd.values import decode_policy_record, encode_policy_record, policy_version

log = logging.getLogger(__name__)


class EtcdPolicyPublisher:
    """Writes {"version", "source_target", "batch_id"} at ``keys.policy()``; never moves
    the version backwards (compare-and-set on the key's revision)."""

    def __init__(self, etcd: Etcd, keys: Keys, source_target: str) -> None:
        self.etcd = etcd
        self.key = keys.policy()
        self.source_target = source_target

    async def publish(self, version: int, batch_id: int, diagnostics: dict[str, Any] | None = None) -> None:
        record: dict[str, Any] = {"source_target": self.source_target, "batch_id": batch_id}
        if diagnostics:
            record["training"] = diagnostics  # the step's loss diagnostics, for the status and dashboard
        value = encode_policy_record(version, **record)
        while True:
            cur = await self.etcd.get(self.key)
            if cur is not None and (policy_version(cur.value) or 0) >= version:
                return  # already announced (a restart re-publishing, or a newer one)
            ok, _ = await self.etcd.txn(
                [mod_revision_is(self.key, cur.mod_revision if cur else 0)], [Op(self.key, value)]
            )
            if ok:
                log.info("policy published", extra={"version": version, "batch_id": batch_id})
                return

    async def current(self) -> dict | None:
        cur = await self.etcd.get(self.key)
        return None if cur is None else decode_policy_record(cur.value)
