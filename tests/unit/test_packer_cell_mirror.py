"""The packer's cell mirror releases a cell's claims only after its registration has been
gone for the grace period: an etcd outage past the lease TTL drops every registration and
the live cells put theirs back at once; they keep their claims. A cell that comes back as
another process (a different registration) loses its old claims."""

from __future__ import annotations

from typing import Any

from gyre.etcd import KV, Keys
from services.packer.store import CellMirror


class _Packer:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def release_cell(self, cell: str) -> None:
        self.released.append(cell)


def _mirror(grace_s: float) -> tuple[CellMirror, _Packer, list[float], Keys]:
    keys = Keys("t")
    packer = _Packer()
    now = [0.0]
    mirror = CellMirror(None, keys, packer, grace_s=grace_s, clock=lambda: now[0])  # type: ignore[arg-type]
    return mirror, packer, now, keys


def _set(mirror: CellMirror, keys: Keys, cells: dict[str, bytes]) -> None:
    items: dict[bytes, Any] = {}
    for cell, value in cells.items():
        key = keys.cell(cell)
        items[key] = KV(key, value, 1, 1, 1, 0)
    mirror._mirror.items = items


async def test_registration_back_within_the_grace_keeps_the_claims():
    mirror, packer, now, keys = _mirror(5.0)
    _set(mirror, keys, {"c0": b"a", "c1": b"b"})
    await mirror.reconcile()
    _set(mirror, keys, {})  # etcd resumed and dropped every lease
    now[0] = 1.0
    await mirror.reconcile()
    now[0] = 2.5
    _set(mirror, keys, {"c0": b"a", "c1": b"b"})  # new sessions put them back
    await mirror.reconcile()
    now[0] = 20.0
    await mirror.reconcile()
    assert packer.released == []


async def test_gone_past_the_grace_releases_once():
    mirror, packer, now, keys = _mirror(5.0)
    _set(mirror, keys, {"c0": b"a", "c1": b"b"})
    await mirror.reconcile()
    _set(mirror, keys, {"c1": b"b"})
    await mirror.reconcile()
    now[0] = 4.9
    await mirror.reconcile()
    assert packer.released == []
    now[0] = 5.0
    await mirror.reconcile()
    now[0] = 9.0
    await mirror.reconcile()
    assert packer.released == ["c0"]


async def test_back_as_another_process_releases_the_old_claims():
    mirror, packer, now, keys = _mirror(5.0)
    _set(mirror, keys, {"c0": b"a"})
    await mirror.reconcile()
    _set(mirror, keys, {})
    await mirror.reconcile()
    now[0] = 1.0
    _set(mirror, keys, {"c0": b"a2"})
    await mirror.reconcile()
    assert packer.released == ["c0"]


async def test_no_grace_releases_at_once():
    mirror, packer, _, keys = _mirror(0.0)
    _set(mirror, keys, {"c0": b"a"})
    await mirror.reconcile()
    _set(mirror, keys, {})
    await mirror.reconcile()
    assert packer.released == ["c0"]
