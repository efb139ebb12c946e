"""``gyre.evolve.evolve`` equals ``dataclasses.replace`` on the records the scheduler
replaces on its hot path, keeps them frozen, and refuses what it cannot copy safely."""

from __future__ import annotations

import dataclasses

import pytest

from gyre.etcd.values import Route
from gyre.evolve import evolve
from gyre.execution import ExecutionStatus
from services.scheduler.ledger import ExecutionRecord


def _record() -> ExecutionRecord:
    return ExecutionRecord("b1-t0-0", 1, 0, "g", "t", 3, ExecutionStatus.RUNNING, "sha", "h", 1.5)


def test_evolve_equals_replace_and_leaves_the_original():
    rec = _record()
    new = evolve(rec, revision=7, state=ExecutionStatus.COMPLETED, reward=1.0)
    assert new == dataclasses.replace(rec, revision=7, state=ExecutionStatus.COMPLETED, reward=1.0)
    assert rec.revision == 0 and rec.state is ExecutionStatus.RUNNING
    assert hash(new) == hash(
        dataclasses.replace(rec, revision=7, state=ExecutionStatus.COMPLETED, reward=1.0)
    )
    route = Route("b1-t0-0", "cell-1", "127.0.0.1:1", "sha", "g", 1, 3)
    assert evolve(route, epoch=1, mod_revision=9) == dataclasses.replace(route, epoch=1, mod_revision=9)


def test_evolve_keeps_frozen_records_frozen():
    new = evolve(_record(), revision=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.revision = 4  # type: ignore[misc]


def test_evolve_refuses_unknown_fields_and_unsafe_classes():
    with pytest.raises(TypeError, match="no field 'revison'"):
        evolve(_record(), revison=3)

    @dataclasses.dataclass
    class Checked:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    with pytest.raises(TypeError, match="plain dataclass"):
        evolve(Checked(1), x=-1)
    with pytest.raises(TypeError, match="plain dataclass"):
        evolve(object(), x=1)
