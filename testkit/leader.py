"""Acting as the elected scheduler in tests: receivers verify fencing epochs against the
leader key in etcd (gyre.fencing), so a test that sends fenced commands creates that key
and fences with its create revision."""

from __future__ import annotations

from gyre.etcd import Etcd, Keys


async def leader_epoch(etcd: Etcd, keys: Keys) -> int:
    """The fencing epoch of the leader key (created if there is none)."""
    await etcd.create(keys.leader(), b"test-leader")
    kv = await etcd.get(keys.leader())
    assert kv is not None
    return kv.create_revision


async def new_leader(etcd: Etcd, keys: Keys) -> int:
    """A failover: the leader key replaced; returns the new (higher) epoch."""
    await etcd.delete(keys.leader())
    return await leader_epoch(etcd, keys)
