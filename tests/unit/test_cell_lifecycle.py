"""The cell lifecycle refuses what its one transition table does not allow, refuses stale
fencing epochs, keeps standalone cells out of training, and changes nothing when it refuses."""

from __future__ import annotations

import itertools

import pytest

from gyre.errors import FailedPrecondition, InvalidArgument, StaleEpoch
from services.cell_agent.lifecycle import TRANSITIONS, CellKind, CellState, Lifecycle
from testkit.lifecycle import ALLOWED

S = CellState


def test_the_table_is_the_designed_lifecycle():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


def _at(state: CellState, kind: CellKind = CellKind.ELASTIC) -> Lifecycle:
    return Lifecycle(kind, clock=lambda: 0.0, state=state)


def test_the_happy_cycle():
    lc = _at(S.STARTING)
    lc.commit(lc.check_unfenced(S.ROLLOUT))
    for target in (S.DRAINING, S.TRAINING, S.RETURNING, S.ROLLOUT):
        lc.commit(lc.check(target, epoch=7))
    assert lc.state is S.ROLLOUT
    assert [t.target for t in lc.history] == [S.ROLLOUT, S.DRAINING, S.TRAINING, S.RETURNING, S.ROLLOUT]


@pytest.mark.parametrize("source,target", list(itertools.product(list(S), list(S))))
def test_every_pair_follows_the_table(source, target):
    lc = _at(source)
    # Naming the current state is an idempotent no-op, except for FAILED (terminal).
    legal = (source, target) in ALLOWED or (target == source and source is not S.FAILED)
    if legal:
        t = lc.check(target, epoch=1)
        lc.commit(t)
        assert lc.state is target
    else:
        with pytest.raises(FailedPrecondition):
            lc.check(target, epoch=1)
        assert lc.state is source


def test_stale_epoch_refused_and_floor_rises():
    lc = _at(S.ROLLOUT)
    lc.commit(lc.check(S.DRAINING, epoch=10))
    with pytest.raises(StaleEpoch):
        lc.check(S.ROLLOUT, epoch=9)
    assert lc.state is S.DRAINING
    # An epoch becomes the floor only with a committed transition (verified by etcd).
    with pytest.raises(FailedPrecondition):
        lc.check(S.RETURNING, epoch=12)
    lc.check(S.TRAINING, epoch=10)
    lc.commit(lc.check(S.TRAINING, epoch=12))
    with pytest.raises(StaleEpoch):
        lc.check(S.RETURNING, epoch=10)
    with pytest.raises(InvalidArgument):
        lc.check(S.TRAINING, epoch=0)


def test_standalone_never_trains():
    lc = _at(S.DRAINING, CellKind.STANDALONE)
    with pytest.raises(FailedPrecondition, match="standalone"):
        lc.check(S.TRAINING, epoch=1)
    lc.commit(lc.check(S.ROLLOUT, epoch=1))


def test_commit_refuses_a_transition_checked_against_another_state():
    lc = _at(S.ROLLOUT)
    t = lc.check(S.DRAINING, epoch=1)
    lc.fail("engine dead")
    with pytest.raises(FailedPrecondition):
        lc.commit(t)
    assert lc.state is S.FAILED


def test_repeat_is_a_noop():
    lc = _at(S.TRAINING)
    t = lc.check(S.TRAINING, epoch=3)
    assert t.noop
    lc.commit(t)
    assert lc.history == []
