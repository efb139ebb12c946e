"""The control loop: level-triggered reconciliation. Each tick closes overdue executions,
rescues the executions of vanished cells, brings stranded cells back, archives closed
bursts, builds the policy's
:class:`~services.scheduler.policy.Snapshot`, and applies what the policy decides."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from gyre.errors import StaleEpoch
from gyre.etcd.values import CellKind
from gyre.staleness import goes_on, oldest_usable, restamp_version, unconsumable
from services.scheduler.bursts import Bursts
from services.scheduler.commands import Commands
from services.scheduler.executions import Executions
from services.scheduler.parts import Part, Shared
from services.scheduler.policy import (
    ASYNC_POLICIES,
    CellState,
    ExecView,
    Pipeline,
    Policy,
    Snapshot,
    VersionCounts,
    training_set,
)
from services.scheduler.publication import Publication
from services.scheduler.supply import SupplyFollower
from services.scheduler.transitions import TransitionRunner

log = logging.getLogger(__name__)


class ControlLoop(Part):
    """Decides with the policy and applies its actions, every ``reconcile_s`` or sooner."""

    def __init__(
        self,
        *,
        shared: Shared,
        policy: Policy,
        bursts: Bursts,
        executions: Executions,
        supply: SupplyFollower,
        publication: Publication,
        transitions: TransitionRunner,
        commands: Commands,
    ) -> None:
        super().__init__(shared=shared)
        self.policy = policy
        self.bursts = bursts
        self.executions = executions
        self.supply = supply
        self.publication = publication
        self.transitions = transitions
        self.commands = commands
        self.continuous = self.cfg.policy in ASYNC_POLICIES
        """The policy dispatches continuously under the staleness gate (bursts overlap)."""
        self.fleet.spread = self.cfg.policy == "gyre" and self.cfg.gyre_plan
        self._drained_since: float | None = None
        self._joined_version = 0

    async def run(self) -> None:
        """Reconciles until deposed (then returns: the process steps down); survives any
        other error."""
        while True:
            if self.lead.deposed.is_set():
                return
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except StaleEpoch as exc:
                self.lead.mark_deposed(exc)
                return
            except Exception:
                log.exception("reconcile failed; retrying next tick")
            await self.changes.wait(self.cfg.reconcile_s)

    async def reconcile_once(self) -> None:
        if not self.lead.leading:
            return
        await self.executions.time_out_overdue()
        for cid in self.fleet.orphaned(self.clock(), self.cfg.orphan_grace_s):
            if not self.transitions.running(cid):
                self.transitions.rescue(cid)
        self._finish_stranded_moves()
        await self.cancel_unconsumable()
        await self.bursts.archive_closed(self.executions.relay.unsettled)
        self._rejoin_after_update()
        snap = self.snapshot()
        for action in self.policy.decide(snap):
            await self.commands.apply(action, snap)
        self.telemetry.gauges()

    async def cancel_unconsumable(self) -> list[str]:
        """The rule for groups that no batch within eta can take (:mod:`gyre.staleness`, the
        same for every policy). Cancel: their open members are cancelled (running ones lose
        their route, queued ones are withdrawn); the packer drops their ready copies by the
        same rule. Partial: a group with a member started goes on, its running members'
        records restamped (members launched later take the stamp too), while the new stamp is
        at most ``partial_max_versions`` past its dispatch; an unstarted one, or one past
        that limit, is cancelled as under cancel. Returns the executions cancelled."""
        version, eta, full = self.publication.version, self.cfg.max_staleness, self._batch_full()
        doomed = [
            (u, g, left) for u, g, left in self.ledger.open_groups() if unconsumable(u, version, full, eta)
        ]
        if not doomed:
            return []
        records, cfg = self.ledger.records, self.cfg
        stamp = restamp_version(version, full, eta)
        going = [
            d
            for d in doomed
            if goes_on(
                cfg.stale_rule,
                any(e in records for e in self.ledger.members(d[1])),
                stamp - self.ledger.dispatched_version(d[1]),
                cfg.partial_max_versions,
            )
        ]
        if going:
            moved = await self.executions.restamp([e for _, _, left in going for e in left], stamp)
            self.telemetry.emit(
                "restamped",
                f"{len(going)} groups stamped v{', v'.join(map(str, sorted({u for u, _, _ in going})))} go on as "
                f"partial rollouts, restamped v{stamp} ({len(moved)} running executions; trainer at v{version}"
                f"{', batch full' if full else ''}, max_staleness {eta})",
                execution_id=moved[0] if len(moved) == 1 else "",
            )
            doomed = [d for d in doomed if d not in going]
            if not doomed:
                return []
        stamps = sorted({u for u, _, _ in doomed})
        why = (
            f"{len(doomed)} groups stamped v{', v'.join(map(str, stamps))} can no longer be trained within "
            f"max_staleness {eta} (trainer at v{version}{', batch full' if full else ''})"
        )
        return await self.executions.cancel([e for _, _, left in doomed for e in left], why)

    def after_takeover(self) -> None:
        """A new leader cannot know which training cells its predecessor had joined to the
        batch (a leader killed between a cell's move to training and its JoinBatch left the
        core training and never joined: nothing trained, no version was published, and the
        run stalled): every training cell this term has not joined joins once (JoinBatch is
        idempotent)."""
        self._joined_version = -1
        self.transitions.forget_joins()

    def _rejoin_after_update(self) -> None:
        """With continuous dispatch there is no burst end: cells stay in training across
        updates, so after each new version (and after a takeover) every training cell joins
        the next batch (the core first; satellites retry until the core has joined)."""
        version = self.publication.version
        if not self.continuous or version <= self._joined_version:
            return
        cells = [
            v
            for v in training_set(self.fleet.cells.views())
            if v.state is CellState.TRAINING and not self.transitions.running(v.cell_id)
        ]
        if self._joined_version < 0:  # after a takeover: the cells this term has not joined
            if not cells:
                return  # the cells' states may not have arrived yet
            cells = [v for v in cells if not self.transitions.joined(v.cell_id)]
        self._joined_version = version
        for v in cells:
            self.transitions.rejoin(v.cell_id)

    def _finish_stranded_moves(self) -> None:
        """A cell an agent reports DRAINING or RETURNING with no transition of ours running
        (a move that failed, or a leader that died before recording it) would hold every
        later move: bring it back to rollout."""
        for cid in self.fleet.cells.records:
            # Overlay first: our last command's outcome beats a watch that has not caught up.
            state = self.fleet.cells.state(cid)
            if state in (CellState.DRAINING, CellState.RETURNING) and not self.transitions.running(cid):
                self.telemetry.emit(
                    "stranded",
                    f"{cid} was left {state.value} with no move in progress: back to rollout",
                    cell_id=cid,
                )
                self.transitions.start(cid, CellState.ROLLOUT, f"stranded in {state.value}")

    def snapshot(self) -> Snapshot:
        """What the policy decides on, now; for the asynchronous policies also the pipeline
        (staleness bound, per-version ledger, trainer backlog, rates), the load of each cell
        and the tail executions."""
        views = self.fleet.cells.views()
        supply = self.supply.observe(len(training_set(views)))
        counts = self.ledger.counts()
        if counts.waterlevel > 0:
            self._drained_since = None
        elif self._drained_since is None:
            self._drained_since = self.clock()
        pipeline: Pipeline | None = None
        executions: tuple[ExecView, ...] = ()
        if self.continuous:
            load = self.fleet.routes.counts()
            views = tuple(dataclasses.replace(v, load=load.get(v.cell_id, 0)) for v in views)
            pipeline, executions = self.pipeline(), self.tail()
        return Snapshot(
            self.clock(),
            counts,
            views,
            supply,
            self.bursts.current(),
            self.publication.version,
            self.bursts.next_quota(continuous=self.continuous),
            self._drained_since,
            pipeline,
            executions,
        )

    def _batch_full(self) -> bool:
        raw = self.supply.raw
        return raw.optimizing or raw.batch_assigned >= self.cfg.batch_size

    def pipeline(self) -> Pipeline:
        """The asynchronous view of the cluster (see policy.snapshot.Pipeline)."""
        cfg, ledger, raw, rates = self.cfg, self.ledger, self.supply.raw, self.supply.rates
        eta, version = cfg.max_staleness, self.publication.version
        groups = ledger.groups_by_version()
        cancelled: dict[int, int] = {}
        for stamp in ledger.cancelled_groups.values():
            cancelled[stamp] = cancelled.get(stamp, 0) + 1
        lo = version - eta - 1
        versions = tuple(
            VersionCounts(
                u, groups.get(u, 0), c.dispatched, c.launched, c.finished, cancelled=cancelled.get(u, 0)
            )
            for u, c in ledger.counts_by_version().items()
            if u >= lo or c.waterlevel > 0
        )
        return Pipeline(
            max_staleness=eta,
            group_size=cfg.group_size,
            batch_groups=cfg.batch_size,
            extra_groups=cfg.groups_per_burst() - cfg.batch_size * cfg.batches_per_burst,
            published_version=self.publication.published,
            groups_dispatched=ledger.tasks_taken,
            groups_cancelled=ledger.groups_cancelled,
            groups_filtered=raw.groups_filtered,
            ready_groups=raw.ready_unassigned,
            batch_assigned=raw.batch_assigned,
            backlog_tokens=raw.backlog_tokens,
            ready_tokens=raw.ready_tokens,
            optimizing=raw.optimizing,
            train_rate_per_cell=rates.train_rate_per_cell,
            ready_rate=rates.ready_rate,
            tokens_per_group=rates.tokens_per_group,
            switch_s=self.transitions.switch_times.round_trip_s,
            kv_tokens_per_cell=self.kv_tokens_per_cell(),
            context_tokens=raw.open_context_tokens,
            versions=versions,
            planned=self.fleet.planned,
        )

    def kv_tokens_per_cell(self) -> float:
        """The smallest KV cache the elastic cells' engines reported, tokens (0: none did).
        The policy counts one per-cell figure; with mixed engines the smallest never packs
        a cell past what its KV keeps."""
        records = self.fleet.cells.records.values()
        sizes = [r.kv_tokens for r in records if r.kind is CellKind.ELASTIC and r.kv_tokens > 0]
        return float(min(sizes, default=0))

    def tail(self, limit: int = 256) -> tuple[ExecView, ...]:
        """Running executions of the oldest version still consumable (the tail the batch
        waits on), for the policy's Migrate."""
        lo = oldest_usable(self.publication.version, self._batch_full(), self.cfg.max_staleness)
        now, out = self.wall(), []
        for route in self.fleet.routes.routes.values():
            rec = self.ledger.records.get(route.execution_id)
            if rec is None or rec.policy_version != lo or route.mod_revision == 0:
                continue  # the record's stamp: the partial rule restamps records, not routes
            out.append(
                ExecView(
                    route.execution_id,
                    route.cell_id,
                    lo,
                    max(0.0, now - rec.launched_s),
                    max(0, route.epoch - 1),
                )
            )
            if len(out) >= limit:
                break
        return tuple(out)
