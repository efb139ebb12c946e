"""The cell agent's etcd adapter: its lease-bound registration and its fenced state writes.

``keys.cell(id)`` holds the registration (kind, index, slots, target, engine, policy
version) and ``keys.cell_state(id)`` the lifecycle state; both are bound to the process
lease, so a dead cell disappears when its lease lapses. A state change ordered by the
scheduler is one transaction that also compares the leader key's create revision with the
command's epoch: a deposed leader's command cannot be persisted, even by a cell that has
not yet seen the new leader.

Given the process's :class:`~gyre.etcd.LeaseKeeper`, the store follows its sessions: after
an etcd outage that cost the lease, both keys are put again, as last written, with the new
lease (the cell reappears as it was; nothing else about it changed).
"""

from __future__ import annotations

from gyre.errors import StaleEpoch
from gyre.etcd import Etcd, Keys, LeaseKeeper, Op
from gyre.etcd.client import LeaseNotFound, create_revision_is
from gyre.etcd.values import CellRecord, CellState, encode_cell_state


class EtcdCellStore:
    """Writes one cell's keys with its process lease."""

    def __init__(self, etcd: Etcd, keys: Keys, cell_id: str, lease: int | LeaseKeeper) -> None:
        self._etcd = etcd
        self._keys = keys
        self._cell_id = cell_id
        self._lease = lease
        self._written: dict[bytes, bytes] = {}
        if isinstance(lease, LeaseKeeper):
            lease.on_new_session(self.renew)

    @property
    def _lease_id(self) -> int:
        return self._lease.lease_id if isinstance(self._lease, LeaseKeeper) else self._lease

    async def register(self, record: CellRecord) -> None:
        key = self._keys.cell(self._cell_id)
        value = record.to_json()
        self._written[key] = value
        await self._put(key, value)

    async def _put(self, key: bytes, value: bytes) -> None:
        try:
            await self._etcd.put(key, value, lease=self._lease_id)
        except LeaseNotFound:
            if not isinstance(self._lease, LeaseKeeper):
                raise
            # The lease lapsed (a slow start, an etcd outage): the keeper's next session
            # puts what was last written (renew).

    async def write_state(self, state: CellState, epoch: int, updated_s: float) -> None:
        key = self._keys.cell_state(self._cell_id)
        value = encode_cell_state(state, epoch, updated_s)
        if epoch <= 0:
            self._written[key] = value
            await self._put(key, value)
            return
        ok, _ = await self._etcd.txn(
            [create_revision_is(self._keys.leader(), epoch)], [Op(key, value, self._lease_id)]
        )
        if not ok:
            raise StaleEpoch(f"epoch {epoch} is not the current scheduler leader's; state not changed")
        self._written[key] = value

    async def renew(self, lease_id: int) -> None:
        """A new lease session: puts the registration and the state again, as last
        written, bound to ``lease_id``."""
        for key, value in list(self._written.items()):
            await self._etcd.put(key, value, lease=lease_id)

    async def verify_leader(self, epoch: int) -> None:
        kv = await self._etcd.get(self._keys.leader())
        if kv is None or kv.create_revision != epoch:
            raise StaleEpoch(f"epoch {epoch} is not the current scheduler leader's")
