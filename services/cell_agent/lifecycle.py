"""The role lifecycle of a cell: one enum of states, one table of allowed transitions, one
``transition()`` that refuses the rest, and the fence check every command passes.

    STARTING --> ROLLOUT --> DRAINING --> TRAINING --> RETURNING --> ROLLOUT
                               |  ^
                               v  |  (a drain can be called off: DRAINING -> ROLLOUT)
                             ROLLOUT
    any state --> FAILED (terminal; the process exits and its lease lapses)

Standalone cells never train. A command that names the current state is a no-op success
(commands are retried after UNAVAILABLE, so they must be idempotent). Pure logic: no grpc,
no etcd; persistence is :mod:`services.cell_agent.store`, side effects are
:mod:`services.cell_agent.cell`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gyre.errors import FailedPrecondition, InvalidArgument, StaleEpoch
from gyre.etcd.values import CellKind, CellState
from gyre.fencing import FenceGuard

S = CellState
TRANSITIONS: dict[CellState, frozenset[CellState]] = {
    S.STARTING: frozenset({S.ROLLOUT, S.FAILED}),
    S.ROLLOUT: frozenset({S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.TRAINING, S.ROLLOUT, S.FAILED}),
    S.TRAINING: frozenset({S.RETURNING, S.FAILED}),
    S.RETURNING: frozenset({S.ROLLOUT, S.FAILED}),
    S.FAILED: frozenset(),
}
"""The one table of allowed transitions."""

ELASTIC_ONLY = frozenset({S.TRAINING, S.RETURNING})
"""States a standalone cell never enters."""

SERVING = frozenset({S.ROLLOUT})
"""States in which the engine takes new requests."""

ENGINE_UP = frozenset({S.STARTING, S.ROLLOUT, S.DRAINING, S.RETURNING})
"""States in which the engine is awake (may hold requests, may load weights, is probed)."""


@dataclasses.dataclass(frozen=True)
class Transition:
    """One accepted state change (``source == target`` for an idempotent repeat)."""

    source: CellState
    target: CellState
    epoch: int
    reason: str

    @property
    def noop(self) -> bool:
        return self.source == self.target


class Lifecycle:
    """The state of one cell and the rules for changing it.

    ``check()`` validates a command (fence, table, kind) without changing anything;
    ``commit()`` records a checked transition once it has been persisted. The split lets
    the caller do the fallible work (drain wait, the fenced etcd write) in between, so a
    refused or failed command leaves the state untouched.
    """

    def __init__(self, kind: CellKind, clock: Callable[[], float], state: CellState = S.STARTING) -> None:
        self.kind = kind
        self._clock = clock
        self._state = state
        self._updated_s = clock()
        self.fence = FenceGuard()
        self.history: list[Transition] = []

    @property
    def state(self) -> CellState:
        return self._state

    @property
    def updated_s(self) -> float:
        return self._updated_s

    @property
    def epoch(self) -> int:
        return int(self.fence.highest)

    def check(self, target: CellState, epoch: int, reason: str = "") -> Transition:
        """Validates a fenced command: StaleEpoch for an epoch older than the newest seen,
        FailedPrecondition for an illegal transition. Records nothing: the epoch becomes
        the floor only when the transition is committed (after etcd verified it), so an
        unverified epoch can never lock the real leader out."""
        self.check_epoch(epoch)
        return self.check_unfenced(target, epoch, reason)

    def check_epoch(self, epoch: int) -> None:
        """Refuses a missing or stale epoch without recording it."""
        if epoch <= 0:
            raise InvalidArgument("a fenced command needs fence.epoch > 0")
        if epoch < self.fence.highest:
            raise StaleEpoch(f"stale fencing epoch {epoch} < {self.fence.highest}")

    def observe_epoch(self, epoch: int) -> None:
        """Raises the floor to a verified epoch."""
        self.fence.observe(epoch)

    def check_unfenced(self, target: CellState, epoch: int = 0, reason: str = "") -> Transition:
        """Validates a transition the cell makes on its own (start-up, failure)."""
        source = self._state
        if target in ELASTIC_ONLY and self.kind is CellKind.STANDALONE:
            raise FailedPrecondition(f"a standalone cell cannot enter {target.name}")
        if target != source and target not in TRANSITIONS[source]:
            raise FailedPrecondition(f"illegal transition {source.name} -> {target.name}")
        if source is S.FAILED:
            raise FailedPrecondition("the cell has failed")
        return Transition(source, target, epoch, reason)

    def commit(self, t: Transition) -> None:
        """Applies a checked transition. Refuses one checked against another state."""
        if t.source != self._state:
            raise FailedPrecondition(
                f"state changed to {self._state.name} while moving {t.source.name} -> {t.target.name}"
            )
        self._state = t.target
        self._updated_s = self._clock()
        if t.epoch > 0:
            self.fence.observe(t.epoch)
        if not t.noop:
            self.history.append(t)

    def fail(self, reason: str) -> Transition:
        """Moves to FAILED from anywhere (no fence: the cell's own verdict)."""
        t = Transition(self._state, S.FAILED, self.epoch, reason)
        self._state = S.FAILED
        self._updated_s = self._clock()
        self.history.append(t)
        return t
