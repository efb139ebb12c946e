"""The packer's etcd adapter: mirrors the published policy version (keys.policy()) into the
packer, so that its staleness rule follows the cluster's newest policy."""

from __future__ import annotations

import asyncio
import json
import logging

from gyre.etcd import Etcd, Keys, PrefixMirror
from gyre.etcd.client import KV
from services.packer.packer import Packer

log = logging.getLogger(__name__)


def policy_version_of(kv: KV | None) -> int | None:
    """The version in a policy record ({"version": int, ...}); None when unreadable."""
    if kv is None:
        return None
    try:
        version = json.loads(kv.value)["version"]
    except (ValueError, KeyError, TypeError):
        log.warning("unreadable policy record", extra={"key": kv.key.decode(errors="replace")})
        return None
    return version if isinstance(version, int) and version >= 0 else None


class PolicyMirror:
    """Follows keys.policy() (list, watch, resync) and feeds new versions to the packer."""

    def __init__(self, etcd: Etcd, keys: Keys, packer: Packer, resync_s: float = 10.0) -> None:
        self._key = keys.policy()
        self._packer = packer
        self._mirror = PrefixMirror(etcd, self._key, resync_s=resync_s)

    async def run(self) -> None:
        task = asyncio.create_task(self._mirror.run(), name="packer.policy_mirror")
        try:
            while True:
                version = policy_version_of(self._mirror.items.get(self._key))
                if version is not None:
                    await self._packer.observe_policy(version)
                await self._mirror.changed(timeout_s=5.0)
                if task.done():
                    await task  # re-raises the mirror's failure
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
