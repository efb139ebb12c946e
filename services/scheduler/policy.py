"""Role decisions as a pure function: snapshot in, actions (each with its reason) out.

This module owns *what* the scheduler decides; it has no I/O (no grpc, no etcd, no asyncio)
and no clock of its own: time comes in ``Snapshot.now_s``. The live scheduler and the
cluster simulator drive the same code, so policies can be compared on the same trace.

Stable API (other code imports it; extend, do not break):

* Snapshot types (frozen dataclasses):
  - :class:`LedgerCounts` ``(dispatched, launched, finished)`` with properties ``queued``
    (Q = D - L), ``running`` (R = L - F) and ``waterlevel`` (W = D - F = Q + R). Counts are
    cumulative over every burst whose executions may still be open, so W is all outstanding
    rollout work (over-provisioned stragglers of an earlier burst count too).
  - :class:`CellView` ``(cell_id, kind, index, state, slots)``; ``kind`` is
    :class:`CellKind` (``STANDALONE`` / ``ELASTIC``), ``index`` is -1 for standalone, 0 for
    the core, 1.. for satellites; ``state`` is :class:`CellState` (the lifecycle of
    ``keys.cell_state``: STARTING, ROLLOUT, DRAINING, TRAINING, RETURNING, FAILED).
  - :class:`Supply` ``(ready_groups, batch_size, batch_needs, batch_id, held_since_s)``:
    ready unassigned groups, already capped by what the current batch still needs; and the
    time since which the supply condition (``ready_groups >= fraction * batch_size``) has
    held without a break (``None``: it does not hold now). Build it with
    :class:`SupplyTracker`, which computes ``held_since_s`` from successive observations.
  - :class:`BurstView` ``(burst_id, quota, policy_version, target_version)``: the current
    burst, the version it was dispatched with, and the published version that ends it
    (``policy_version + batches per burst``).
  - :class:`Snapshot` ``(now_s, ledger, cells, supply, burst, policy_version, next_quota,
    drained_since_s=None)``: ``policy_version`` is the newest published policy;
    ``next_quota`` is how many executions the next burst would dispatch (0: the task source
    is exhausted); ``drained_since_s`` is since when W has been 0 (None: W > 0 or unknown).
* Actions (frozen dataclasses, each with ``kind`` and ``reason``): :class:`MoveToTraining`,
  :class:`ReturnToRollout`, :class:`KeepInTraining`, :class:`PublishPolicy`,
  :class:`DispatchBurst`, :class:`SealBatch` (only when ``drained_since_s`` is given: a
  drained burst's partial batch is sealed; a burst with nothing trainable is followed by the
  next), and :class:`Hold` (informational only: why nothing moved).
  A caller applies them in the order given. ``PublishPolicy`` repeats while the last burst
  stays trained and no next burst comes (task source exhausted): apply it once per version.
* ``Policy`` protocol: ``name`` and ``decide(snapshot) -> list[Action]``. Implementations:
  :class:`WaterlevelPolicy` (Gyre), :class:`ColocatedSyncPolicy` and
  :class:`StaticSplitPolicy` (the baselines), :class:`RolloutOnlyPolicy` (no training: bursts
  back to back), configured by :class:`WaterlevelConfig` /
  :class:`StaticSplitConfig`. :func:`make_policy` builds one by name.
* Helpers: :func:`capacity` (slots of standalone cells in ROLLOUT + elastic cells in
  ROLLOUT), :func:`training_set` (elastic cells in DRAINING or TRAINING: on their way to or
  in training), :func:`is_prefix` (the training set is the lowest-index elastic cells).

``decide`` is level-triggered: called with the same snapshot it returns the same actions,
so the caller must apply them (and let the next snapshot reflect them) before asking again.
A cell whose move is in progress shows up as DRAINING or RETURNING; the waterlevel policy
starts no move while any elastic cell is DRAINING or RETURNING (one at a time), never
moves a satellite before the core (index 0), and returns training cells that a cell loss or
restart left outside the prefix (or without a training core).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence
from typing import Protocol, Union


class CellKind(enum.Enum):
    """Whether a cell can change role (values as in ``keys.cell`` JSON)."""

    STANDALONE = "standalone"
    ELASTIC = "elastic"


class CellState(enum.Enum):
    """The role lifecycle of a cell (values as in ``keys.cell_state`` JSON)."""

    STARTING = "STARTING"
    ROLLOUT = "ROLLOUT"
    DRAINING = "DRAINING"
    TRAINING = "TRAINING"
    RETURNING = "RETURNING"
    FAILED = "FAILED"


# Snapshot ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LedgerCounts:
    """Cumulative D / L / F of the executions the scheduler still answers for."""

    dispatched: int = 0
    launched: int = 0
    finished: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.finished <= self.launched <= self.dispatched:
            raise ValueError(f"ledger needs 0 <= F <= L <= D, got {self}")

    @property
    def queued(self) -> int:
        """Q = D - L: dispatched, not launched yet."""
        return self.dispatched - self.launched

    @property
    def running(self) -> int:
        """R = L - F: launched, not closed yet."""
        return self.launched - self.finished

    @property
    def waterlevel(self) -> int:
        """W = D - F = Q + R: committed rollout work."""
        return self.dispatched - self.finished


@dataclasses.dataclass(frozen=True)
class CellView:
    """One cell as the policy sees it."""

    cell_id: str
    kind: CellKind
    index: int
    state: CellState
    slots: int

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"{self.cell_id}: slots must be >= 0")
        if self.kind is CellKind.STANDALONE and self.index != -1:
            raise ValueError(f"{self.cell_id}: a standalone cell has index -1")
        if self.kind is CellKind.ELASTIC and self.index < 0:
            raise ValueError(f"{self.cell_id}: an elastic cell has index >= 0")

    @property
    def elastic(self) -> bool:
        return self.kind is CellKind.ELASTIC

    @property
    def is_core(self) -> bool:
        return self.kind is CellKind.ELASTIC and self.index == 0


@dataclasses.dataclass(frozen=True)
class Supply:
    """Training supply: ready unassigned groups (capped by the batch's need) and history."""

    ready_groups: int = 0
    batch_size: int = 1
    batch_needs: int = 0
    batch_id: int = 0
    held_since_s: float | None = None

    @property
    def fraction(self) -> float:
        """Ready groups as a fraction of the batch size (the "supply 0.62" of a reason)."""
        return self.ready_groups / self.batch_size if self.batch_size > 0 else 0.0

    def held_for(self, now_s: float) -> float:
        """How long the supply condition has held (0 when it does not hold)."""
        return 0.0 if self.held_since_s is None else max(0.0, now_s - self.held_since_s)


@dataclasses.dataclass(frozen=True)
class BurstView:
    """The current burst."""

    burst_id: int
    quota: int
    policy_version: int
    target_version: int

    def trained(self, published_version: int) -> bool:
        """True once the burst's final update has been published."""
        return published_version >= self.target_version


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything a policy decides on."""

    now_s: float
    ledger: LedgerCounts
    cells: tuple[CellView, ...]
    supply: Supply
    burst: BurstView | None
    policy_version: int
    next_quota: int = 0
    drained_since_s: float | None = None
    """Since when no execution has been open (W = 0); None while W > 0 or when unknown.
    Lets a policy tell "the burst is over and its batch will not fill" from a lull."""

    def drained_for(self, grace_s: float) -> bool:
        """True once W has been 0 for ``grace_s`` (finish reports had time to land)."""
        return (
            self.ledger.waterlevel == 0 and self.drained_since_s is not None
            and self.now_s - self.drained_since_s >= grace_s
        )

    def elastic(self) -> list[CellView]:
        """Elastic cells by index (the core first)."""
        return sorted((c for c in self.cells if c.elastic), key=lambda c: c.index)


class SupplyTracker:
    """Turns successive supply observations into :class:`Supply` with ``held_since_s``.

    The condition is ``min(ready, batch_needs) >= fraction * batch_size``; it must hold
    without a break (a batch change breaks it). Pure: time is passed in.
    """

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError("fraction must be in (0, 1]")
        self.fraction = fraction
        self._held_since: float | None = None
        self._batch_id: int | None = None

    def observe(self, now_s: float, ready_groups: int, batch_size: int, batch_needs: int,
            batch_id: int = 0) -> Supply:
        ready = max(0, min(ready_groups, batch_needs))
        if batch_id != self._batch_id:
            self._held_since = None
            self._batch_id = batch_id
        holds = batch_size > 0 and ready >= self.fraction * batch_size
        if not holds:
            self._held_since = None
        elif self._held_since is None:
            self._held_since = now_s
        return Supply(ready, batch_size, batch_needs, batch_id, self._held_since)


# Actions -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoveToTraining:
    """Drain the cell, reroute its executions, then switch it to training."""

    cell_id: str
    reason: str
    kind: str = "cell_to_training"


@dataclasses.dataclass(frozen=True)
class ReturnToRollout:
    """Take the cell out of training (load the newest policy) and back to rollout."""

    cell_id: str
    reason: str
    kind: str = "cell_to_rollout"


@dataclasses.dataclass(frozen=True)
class KeepInTraining:
    """The core stays in training for the next batch (burst end)."""

    cell_id: str
    reason: str
    kind: str = "core_kept"


@dataclasses.dataclass(frozen=True)
class PublishPolicy:
    """Load policy ``version`` (from the core) on every rollout engine."""

    version: int
    source_cell_id: str
    reason: str
    kind: str = "policy_published"


@dataclasses.dataclass(frozen=True)
class DispatchBurst:
    """Publish a burst of ``quota`` new executions with ``policy_version``."""

    burst_id: int
    quota: int
    policy_version: int
    reason: str
    kind: str = "burst_started"


@dataclasses.dataclass(frozen=True)
class SealBatch:
    """Tell the packer to seal batch ``batch_id`` with the groups it has: the burst is
    drained and no more groups will come for it."""

    batch_id: int
    reason: str
    kind: str = "batch_sealed"


@dataclasses.dataclass(frozen=True)
class Hold:
    """Nothing moves; the reason says which check failed (informational)."""

    reason: str
    cell_id: str = ""
    kind: str = "hold"


Action = Union[MoveToTraining, ReturnToRollout, KeepInTraining, PublishPolicy, DispatchBurst, SealBatch, Hold]


class Policy(Protocol):
    """A role policy: a pure function of a snapshot."""

    name: str

    def decide(self, snapshot: Snapshot) -> list[Action]:
        ...


# Helpers -----------------------------------------------------------------------------------

_TRAINING_SIDE = (CellState.DRAINING, CellState.TRAINING)
_IN_FLIGHT = (CellState.DRAINING, CellState.RETURNING)


def capacity(cells: Iterable[CellView]) -> int:
    """Rollout capacity: slots of every cell (standalone or elastic) in ROLLOUT."""
    return sum(c.slots for c in cells if c.state is CellState.ROLLOUT)


def training_set(cells: Iterable[CellView]) -> list[CellView]:
    """Elastic cells in or on their way to training, by index."""
    return sorted((c for c in cells if c.elastic and c.state in _TRAINING_SIDE), key=lambda c: c.index)


def is_prefix(cells: Sequence[CellView]) -> bool:
    """True when the training set is the lowest-index elastic cells present (FAILED cells,
    about to vanish with their lease, are not counted)."""
    elastic = sorted((c for c in cells if c.elastic and c.state is not CellState.FAILED),
            key=lambda c: c.index)
    k = len(training_set(elastic))
    return all(c.state in _TRAINING_SIDE for c in elastic[:k])


def _fmt(x: float) -> str:
    return f"{x:g}"


def _next_burst(s: Snapshot, reason: str) -> list[Action]:
    if s.next_quota <= 0:
        return []
    burst_id = (s.burst.burst_id + 1) if s.burst is not None else 1
    return [DispatchBurst(burst_id, s.next_quota, s.policy_version, reason)]


def _drained(s: Snapshot, grace_s: float, training: Sequence[CellView]) -> list[Action] | None:
    """A burst whose executions have all closed (for ``grace_s``) while its batch is not
    trained: seal a partial batch that cells are training on, or, when nothing trainable
    came out of it, go on with the next burst. None: nothing special to do."""
    if s.burst is None or not s.drained_for(grace_s):
        return None
    sup = s.supply
    b = s.burst.burst_id
    if training and 0 < sup.batch_needs < sup.batch_size:
        have = sup.batch_size - sup.batch_needs
        return [SealBatch(sup.batch_id,
                f"sealed batch {sup.batch_id} with {have} of {sup.batch_size} groups: burst {b} drained (W 0)")]
    if not training and sup.ready_groups == 0 and sup.batch_needs >= sup.batch_size:
        # (With cells training, a sealed batch is being trained while the packer already
        # fills the next one: wait for its publication, which ends the burst.)
        return _next_burst(s,
                f"burst {b} yielded no trainable groups: burst {b + 1} with {s.next_quota} executions "
                f"at policy v{s.policy_version}")
    return None


# Gyre: the waterlevel policy ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WaterlevelConfig:
    """Parameters of :class:`WaterlevelPolicy`."""

    fraction: float = 0.5
    """Ready groups needed, as a fraction of the batch size, in (0, 1]."""
    interval_s: float = 5.0
    """How long the supply condition must hold before a move, seconds (>= 0)."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a burst counts as drained (see Snapshot.drained_since_s)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError("fraction must be in (0, 1]")
        if not (self.interval_s >= 0.0 and math.isfinite(self.interval_s)):
            raise ValueError("interval_s must be finite and >= 0")
        if not (self.drain_grace_s >= 0.0 and math.isfinite(self.drain_grace_s)):
            raise ValueError("drain_grace_s must be finite and >= 0")


class WaterlevelPolicy:
    """Gyre: move the next elastic cell to training only when rollout capacity left behind
    covers the waterlevel and the training supply has held; return satellites at burst end.

    Mid-burst: at most one move per decision and none while any elastic cell is in flight
    (DRAINING, RETURNING); the candidate is the lowest-index elastic cell after
    the training prefix, and it must be in ROLLOUT. Checks, in order: capacity after the
    move >= W; supply >= fraction * batch_size held for interval_s.

    Burst end (the burst's final version published): every satellite in training returns;
    the new version is published to rollout engines; the core stays in training only if
    capacity without it covers W plus the next burst's quota and the supply check passes;
    then the next burst is dispatched.
    """

    name = "waterlevel"

    def __init__(self, config: WaterlevelConfig | None = None) -> None:
        self.config = config or WaterlevelConfig()

    def tracker(self) -> SupplyTracker:
        """A supply tracker with this policy's fraction."""
        return SupplyTracker(self.config.fraction)

    def supply_ok(self, s: Snapshot) -> tuple[bool, str]:
        cfg = self.config
        need = cfg.fraction * s.supply.batch_size
        held = s.supply.held_for(s.now_s)
        frac = s.supply.fraction
        if s.supply.ready_groups < need or s.supply.held_since_s is None:
            return False, f"supply {frac:.2f} < {_fmt(cfg.fraction)}"
        if held < cfg.interval_s:
            return False, f"supply {frac:.2f} >= {_fmt(cfg.fraction)} for {held:.1f} s < {cfg.interval_s:.1f} s"
        return True, f"supply {frac:.2f} >= {_fmt(cfg.fraction)} for {held:.1f} s"

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return _next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        if s.burst.trained(s.policy_version):
            return self._burst_end(s)
        return self._mid_burst(s)

    def _mid_burst(self, s: Snapshot) -> list[Action]:
        elastic = s.elastic()
        prefix = training_set(elastic)
        repair = self._repair(elastic, prefix)
        if repair:
            return repair
        busy = [c for c in elastic if c.state in _IN_FLIGHT]
        if busy:
            return [Hold(f"waiting: {busy[0].cell_id} is {busy[0].state.value}", busy[0].cell_id)]
        drained = _drained(s, self.config.drain_grace_s, prefix)
        if drained is not None:
            return drained
        rest = [c for c in elastic if c.state not in _TRAINING_SIDE and c.state is not CellState.FAILED]
        if not rest:
            return []
        cand = rest[0]
        if not prefix and not cand.is_core:
            return [Hold("waiting: no core cell (index 0) to start training with")]
        if cand.state is not CellState.ROLLOUT or any(c.index > cand.index for c in prefix):
            return [Hold(f"waiting: next cell {cand.cell_id} is {cand.state.value}", cand.cell_id)]
        w = s.ledger.waterlevel
        after = capacity(s.cells) - cand.slots
        if after < w:
            return [Hold(f"kept {cand.cell_id} in rollout: capacity {after} < W {w}", cand.cell_id)]
        ok, why = self.supply_ok(s)
        if not ok and not prefix and s.supply.ready_groups > 0 and s.drained_for(self.config.drain_grace_s):
            # Nothing more will come for this batch: train on what is ready.
            ok, why = True, f"burst {s.burst.burst_id if s.burst else 0} drained with {s.supply.ready_groups} ready groups"
        if not ok:
            return [Hold(f"kept {cand.cell_id} in rollout: {why}", cand.cell_id)]
        return [MoveToTraining(cand.cell_id,
                f"moved {cand.cell_id} to training: capacity {after} >= W {w}, {why}")]

    @staticmethod
    def _repair(elastic: list[CellView], prefix: list[CellView]) -> list[Action]:
        """After a cell loss or restart: training without the core is pointless, and cells
        above a gap in the prefix break the order; both go back to rollout."""
        if not prefix:
            return []
        if not prefix[0].is_core:
            return [ReturnToRollout(c.cell_id,
                    f"returned {c.cell_id} to rollout: the core is not training") for c in prefix]
        alive = [c for c in elastic if c.state is not CellState.FAILED]
        k = next((i for i, c in enumerate(alive) if c.state not in _TRAINING_SIDE), len(alive))
        return [
            ReturnToRollout(c.cell_id,
                    f"returned {c.cell_id} to rollout: {alive[k].cell_id} broke the training prefix")
            for c in alive[k:] if c.state in _TRAINING_SIDE
        ]

    def _burst_end(self, s: Snapshot) -> list[Action]:
        assert s.burst is not None
        actions: list[Action] = []
        elastic = s.elastic()
        core = next((c for c in elastic if c.is_core), None)
        v = s.policy_version
        for c in elastic:
            if not c.is_core and c.state in _TRAINING_SIDE:
                actions.append(ReturnToRollout(c.cell_id,
                        f"returned {c.cell_id} to rollout: burst {s.burst.burst_id} ended at v{v}"))
        source = core.cell_id if core is not None else ""
        actions.append(PublishPolicy(v, source,
                f"published policy v{v} from {source or 'core'} to rollout engines"))
        if core is not None and core.state in _TRAINING_SIDE:
            # Capacity once the satellites are back, without the core.
            back = sum(
                c.slots for c in s.cells
                if c.state is CellState.ROLLOUT
                or (c.elastic and not c.is_core and c.state in (*_TRAINING_SIDE, CellState.RETURNING))
            )
            pending = s.ledger.waterlevel + max(0, s.next_quota)
            ok, why = self.supply_ok(s)
            if s.next_quota > 0 and back >= pending and ok:
                actions.append(KeepInTraining(core.cell_id,
                        f"kept {core.cell_id} in training: capacity {back} >= W {pending} (with next burst), {why}"))
            else:
                cause = "no next burst" if s.next_quota <= 0 else (
                    f"capacity {back} < W {pending} (with next burst)" if back < pending else why)
                actions.append(ReturnToRollout(core.cell_id, f"returned {core.cell_id} to rollout: {cause}"))
        actions += _next_burst(s, f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}")
        return actions


# Baselines ---------------------------------------------------------------------------------


class ColocatedSyncPolicy:
    """Colocated synchronous: every elastic cell rolls out until the burst's executions
    have all closed (W = 0, the barrier), then every elastic cell trains; at burst end all
    return, the policy is published and the next burst is dispatched."""

    name = "colocated"

    def __init__(self, drain_grace_s: float = 2.0) -> None:
        self.drain_grace_s = drain_grace_s

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return _next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        elastic = s.elastic()
        v = s.policy_version
        if s.burst.trained(v):
            actions: list[Action] = [
                ReturnToRollout(c.cell_id,
                        f"returned {c.cell_id} to rollout: burst {s.burst.burst_id} ended at v{v}")
                for c in elastic if c.state in _TRAINING_SIDE
            ]
            core = next((c for c in elastic if c.is_core), None)
            actions.append(PublishPolicy(v, core.cell_id if core else "",
                    f"published policy v{v} to rollout engines"))
            return actions + _next_burst(s,
                    f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}")
        w = s.ledger.waterlevel
        if w > 0:
            return [Hold(f"barrier: W {w} > 0")]
        drained = _drained(s, self.drain_grace_s, training_set(elastic))
        if drained is not None:
            return drained
        return [
            MoveToTraining(c.cell_id, f"moved {c.cell_id} to training: barrier reached (W 0)")
            for c in elastic if c.state is CellState.ROLLOUT
        ]


@dataclasses.dataclass(frozen=True)
class StaticSplitConfig:
    """Parameters of :class:`StaticSplitPolicy`."""

    training_cells: int = 1
    """T: the lowest-index elastic cells that always train (the rest always roll out)."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a burst counts as drained."""

    def __post_init__(self) -> None:
        if self.training_cells < 0:
            raise ValueError("training_cells must be >= 0")


class StaticSplitPolicy:
    """Static split R:T: the first ``training_cells`` elastic cells train, the others roll
    out, whatever the waterlevel; bursts follow each other at policy publication."""

    name = "static"

    def __init__(self, config: StaticSplitConfig | None = None) -> None:
        self.config = config or StaticSplitConfig()

    def decide(self, s: Snapshot) -> list[Action]:
        elastic = s.elastic()
        t = self.config.training_cells
        actions: list[Action] = []
        for i, c in enumerate(elastic):
            if i < t and c.state is CellState.ROLLOUT:
                actions.append(MoveToTraining(c.cell_id,
                        f"moved {c.cell_id} to training: static split {len(elastic) - t}:{t}"))
            elif i >= t and c.state in _TRAINING_SIDE:
                actions.append(ReturnToRollout(c.cell_id,
                        f"returned {c.cell_id} to rollout: static split {len(elastic) - t}:{t}"))
        if s.burst is None:
            return actions + _next_burst(s,
                    f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        v = s.policy_version
        if s.burst.trained(v):
            core = next((c for c in elastic if c.is_core), None)
            actions.append(PublishPolicy(v, core.cell_id if core else "",
                    f"published policy v{v} to rollout engines"))
            actions += _next_burst(s,
                    f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}")
        elif not actions:
            actions += _drained(s, self.config.drain_grace_s, training_set(elastic)) or []
        return actions


class RolloutOnlyPolicy:
    """No training (the walking skeleton, or a cluster without trainers): the next burst is
    dispatched once every execution of the current one has closed."""

    name = "rollout_only"

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return _next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        if s.ledger.waterlevel > 0:
            return []
        return _next_burst(s,
                f"burst {s.burst.burst_id + 1}: {s.next_quota} executions (burst {s.burst.burst_id} closed)")


def make_policy(name: str, *, fraction: float = 0.5, interval_s: float = 5.0, training_cells: int = 1,
                drain_grace_s: float = 2.0) -> Policy:
    """Builds a policy by name: "waterlevel" (Gyre), "colocated", "static" or "rollout_only"."""
    if name == "waterlevel":
        return WaterlevelPolicy(WaterlevelConfig(fraction, interval_s, drain_grace_s))
    if name == "colocated":
        return ColocatedSyncPolicy(drain_grace_s)
    if name == "static":
        return StaticSplitPolicy(StaticSplitConfig(training_cells, drain_grace_s))
    if name == "rollout_only":
        return RolloutOnlyPolicy()
    raise ValueError(f"unknown policy {name!r} (waterlevel, colocated, static, rollout_only)")
