"""What a policy sees: the :class:`Snapshot` and its parts (frozen, typed, no I/O).

The burst-synchronous fields (``ledger``, ``supply``, ``burst``, ``next_quota``,
``drained_since_s``) are what the seed's waterlevel policy needs and what the live scheduler
fills today. The asynchronous policies (Gyre, the async static baselines) also read
``pipeline`` (:class:`Pipeline`): the staleness bound, the per-version ledger, the trainer's
backlog and the rates of supply and training. A caller that cannot fill ``pipeline`` leaves it
``None``; the asynchronous policies then hold (they never guess).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from gyre.etcd.values import CellKind as CellKind  # re-exported: the policy speaks of cells in these
from gyre.etcd.values import CellState as CellState


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
        """W = D - F = Q + R: committed rollout work (the seed's definition)."""
        return self.dispatched - self.finished


@dataclasses.dataclass(frozen=True)
class CellView:
    """One cell as the policy sees it; ``load`` is the executions routed to it now."""

    cell_id: str
    kind: CellKind
    index: int
    state: CellState
    slots: int
    load: int = 0

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
    """The current (latest) burst."""

    burst_id: int
    quota: int
    policy_version: int
    target_version: int

    def trained(self, published_version: int) -> bool:
        """True once the burst's final update has been published."""
        return published_version >= self.target_version


@dataclasses.dataclass(frozen=True)
class VersionCounts:
    """The per-version ledger: the groups stamped with ``version`` (the policy version they
    were dispatched with, which they serve) and their executions.

    Groups: ``groups`` dispatched, ``ready`` (every member closed, not yet assigned),
    ``consumed`` (assigned to a batch), ``cancelled`` (unconsumable within the staleness
    bound, see :mod:`.staleness`). Executions: ``dispatched`` / ``launched`` / ``finished``
    (a cancelled execution counts as finished, as in the seed's ledger)."""

    version: int
    groups: int = 0
    dispatched: int = 0
    launched: int = 0
    finished: int = 0
    ready: int = 0
    consumed: int = 0
    cancelled: int = 0

    @property
    def open(self) -> int:
        """Executions of this version still queued or running."""
        return self.dispatched - self.finished

    @property
    def open_groups(self) -> int:
        """Groups of this version with a member still open."""
        return max(0, self.groups - self.ready - self.consumed - self.cancelled)


@dataclasses.dataclass(frozen=True)
class ExecView:
    """One open execution, for tail control (:class:`~.actions.Migrate`)."""

    execution_id: str
    cell_id: str
    version: int
    running_s: float
    moves: int = 0
    """How often it was rerouted or migrated already."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The asynchronous view: staleness bound, per-version ledger, trainer and rates.

    Rates are measured by the caller over a recent window; ``0`` means "not observed yet"
    (a policy then falls back to counts). Tokens are training tokens.
    """

    max_staleness: int
    """eta: a group stamped with version u may be consumed by batches u .. u + eta only."""
    group_size: int
    batch_groups: int
    """B: groups per training batch (one update each)."""
    extra_groups: int = 0
    """X: over-provision, in groups, allowed in flight beyond the staleness gate."""
    published_version: int = 0
    """The version rollout engines serve."""
    groups_dispatched: int = 0
    groups_cancelled: int = 0
    groups_filtered: int = 0
    """Groups dropped after they closed without the scheduler cancelling them (the packer's
    zero-variance, failed-member and stale drops): no batch will take them."""
    groups_consumed: int = 0
    ready_groups: int = 0
    """Ready, unassigned, consumable groups: uncapped (supply beyond the current batch)."""
    batch_assigned: int = 0
    """Groups assigned to the batch in progress."""
    backlog_tokens: float = 0.0
    """Tokens assigned to the batch in progress and not trained yet."""
    ready_tokens: float = 0.0
    """Tokens of the ready, unassigned groups."""
    optimizing: bool = False
    """The optimizer step of the batch in progress is running (its window is closed)."""
    train_rate_per_cell: float = 0.0
    """Training throughput of one cell, tokens/s."""
    ready_rate: float = 0.0
    """Recent arrival rate of ready groups, groups/s."""
    tokens_per_group: float = 0.0
    """Recent mean training tokens per ready group."""
    switch_s: float = 0.0
    """Measured seconds of a role switch round trip (to training and back, the recent mean of
    each direction); 0: not measured yet."""
    kv_tokens_per_cell: float = 0.0
    """KV cache of one rollout cell, tokens (vLLM: GPU blocks x block size); 0: unknown."""
    context_tokens: float = 0.0
    """Recent mean context of a launched, open execution, tokens: the KV it keeps resident
    (running, or cached while its tool runs); 0: not measured yet."""
    kv_recompute_share: float = 0.0
    """Share of the rollout cells' time recently spent prefilling again the prefixes their KV
    evicted or preempted; 0: none, or not measured."""
    kv_recompute_peak: float | None = None
    """The highest ``kv_recompute_share`` measured so far in the run; None: recompute is not
    measured here (the live scheduler today), so nothing is known about it."""
    versions: tuple[VersionCounts, ...] = ()
    planned: tuple[str, ...] = ()
    """Cells the last :class:`~.actions.PlanMoves` named (placement avoids them)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("batch_groups and group_size must be >= 1")
        if self.extra_groups < 0:
            raise ValueError("extra_groups must be >= 0")

    def kv_slots(self, slots: int) -> int:
        """Executions a cell of ``slots`` holds without evicting: its slots, or fewer when its
        KV cache cannot keep that many contexts resident (each one beyond it evicts cached
        prefixes, and every turn of an evicted execution prefills its whole context again)."""
        if self.kv_tokens_per_cell <= 0 or self.context_tokens <= 0:
            return slots
        return max(1, min(slots, int(self.kv_tokens_per_cell // self.context_tokens)))

    @property
    def usable_dispatched(self) -> int:
        """Groups dispatched and neither cancelled nor filtered out (what the staleness gate
        counts): a group no batch will take leaves the gate and is replaced. Filtered groups
        used to stay in it; once a learning policy's groups all earned reward 1 (dropped for
        zero variance) the gate filled with them and dispatch stopped for good."""
        return self.groups_dispatched - self.groups_cancelled - self.groups_filtered


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
    pipeline: Pipeline | None = None
    """The asynchronous view (None: the caller only knows bursts)."""
    executions: tuple[ExecView, ...] = ()
    """Open executions the caller chose to show: those on planned cells and the tail of the
    oldest consumable version (bounded; empty when unknown)."""

    def drained_for(self, grace_s: float) -> bool:
        """True once W has been 0 for ``grace_s`` (finish reports had time to land)."""
        return (
            self.ledger.waterlevel == 0
            and self.drained_since_s is not None
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

    def observe(
        self, now_s: float, ready_groups: int, batch_size: int, batch_needs: int, batch_id: int = 0
    ) -> Supply:
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


# Helpers -----------------------------------------------------------------------------------

TRAINING_SIDE = (CellState.DRAINING, CellState.TRAINING)
IN_FLIGHT = (CellState.DRAINING, CellState.RETURNING)


def capacity(cells: Iterable[CellView]) -> int:
    """Rollout capacity: slots of every cell (standalone or elastic) in ROLLOUT."""
    return sum(c.slots for c in cells if c.state is CellState.ROLLOUT)


def training_set(cells: Iterable[CellView]) -> list[CellView]:
    """Elastic cells in or on their way to training, by index."""
    return sorted((c for c in cells if c.elastic and c.state in TRAINING_SIDE), key=lambda c: c.index)


def is_prefix(cells: Sequence[CellView]) -> bool:
    """True when the training set is the lowest-index elastic cells present (FAILED cells,
    about to vanish with their lease, are not counted)."""
    elastic = sorted(
        (c for c in cells if c.elastic and c.state is not CellState.FAILED), key=lambda c: c.index
    )
    k = len(training_set(elastic))
    return all(c.state in TRAINING_SIDE for c in elastic[:k])
