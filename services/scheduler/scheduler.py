"""The scheduler process's composition root: builds the parts, rebuilds them from etcd when
this process becomes the leader, and is what the gRPC edge and ``__main__`` talk to.

Where each concern lives (every part has a typed interface; none reaches into another):

* :mod:`leadership` - epoch, deposition, the fenced store;
* :mod:`fleet` - cells, routes, routers, engine versions, commands to cell agents;
* :mod:`bursts` (+ the pure :mod:`ledger` and its :mod:`accounts`) - dispatching bursts, D / L / F;
* :mod:`executions` - acquire, heartbeat, finish, time-outs;
* :mod:`relay` - finish reports to the packer;
* :mod:`supply` - the packer's supply signal;
* :mod:`publication` - the newest policy version and loading it on rollout engines;
* :mod:`transitions` - moving cells between roles, reroutes, rescues (+ :mod:`joins`, JoinBatch);
* :mod:`failures` - engine failures reported by routers (probe, mark down, reroute at once);
* :mod:`commands` - the policy's actions carried out (``match`` over the action union);
* :mod:`control` - the control loop and the policy's snapshot;
* :mod:`status` - the typed status; :mod:`telemetry` - events, metrics, wake-ups;
* :mod:`parts` - ``Shared``, what every part is built with (by keyword).

It never imports grpc. Every change follows plan -> fenced write -> apply, so memory never
runs ahead of etcd; a write refused for a stale epoch marks the process deposed, and
:meth:`Scheduler.step_down` makes it a standby again (fresh parts; ``__main__`` campaigns
again and a win rebuilds everything from etcd, as a failover would).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from gyre.apikeys import KeyFile
from services.scheduler.bursts import Bursts
from services.scheduler.commands import Commands
from services.scheduler.config import SchedulerConfig
from services.scheduler.control import ControlLoop
from services.scheduler.events import EventLog, Metrics
from services.scheduler.executions import Acquired, Executions, Launched
from services.scheduler.failures import EngineFailures
from services.scheduler.fleet import Fleet
from services.scheduler.harness_gate import HarnessGate
from services.scheduler.history import History
from services.scheduler.leadership import Leadership
from services.scheduler.ledger import Ledger
from services.scheduler.parts import Shared
from services.scheduler.peers import FinishReport, Peers, SupplyUpdate
from services.scheduler.placement import CellTable, RouteTable
from services.scheduler.policy import Policy, capacity, make_policy
from services.scheduler.publication import Publication
from services.scheduler.relay import FinishRelay
from services.scheduler.status import SchedulerStatus, cell_statuses
from services.scheduler.store import Store
from services.scheduler.supply import SupplyFollower
from services.scheduler.tasks import TaskSource
from services.scheduler.telemetry import Changes, Reading, Telemetry
from services.scheduler.transitions import TransitionRunner

__all__ = ["Acquired", "Launched", "Scheduler"]


class Scheduler:
    """One scheduler process; acts only while it leads."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        store: Store | None,
        peers: Peers,
        tasks: TaskSource,
        events: EventLog | None = None,
        metrics: Metrics | None = None,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config
        self.peers = peers
        self.clock = clock
        self._wall = wall
        self._policy_given = policy
        self._tasks = tasks
        self.history = History.of(config)  # one history across leaderships (_build runs again)
        self._build(store, events or EventLog(config.events_kept), metrics)

    def _build(self, store: Store | None, events: EventLog, metrics: Metrics | None) -> None:
        """Builds every part from nothing (at start, and after a step-down)."""
        cfg, peers, clock, wall, tasks = self.cfg, self.peers, self.clock, self._wall, self._tasks
        self.policy = self._policy_given or make_policy(
            cfg.policy,
            fraction=cfg.fraction,
            interval_s=cfg.interval_s,
            training_cells=cfg.static_training_cells,
            drain_grace_s=cfg.drain_grace_s,
            gyre=cfg.gyre_config(cfg.drain_grace_s),
        )
        self.lead = Leadership(store)
        self.ledger = Ledger()
        self.fleet = Fleet(self.lead, cfg.router_target)
        self.changes = Changes()
        self.supply = SupplyFollower(
            peers=peers,
            batch_size=cfg.batch_size,
            fraction=cfg.fraction,
            clock=clock,
            changes=self.changes,
            rate_window_s=cfg.rate_window_s,
        )
        self.telemetry = Telemetry(events, metrics, self._reading)
        self.harnesses = HarnessGate(
            keys=KeyFile.load(cfg.harness_keys_file) if cfg.harness_keys_file else None,
            require_key=cfg.harness_require_key,
            max_inflight=cfg.harness_max_inflight,
            rate_per_s=cfg.harness_acquire_rate_per_s,
            burst=cfg.harness_acquire_burst,
            trust_unauthenticated=cfg.tls.insecure and not cfg.harness_keys_file,
            clock=clock,
        )
        self.relay = FinishRelay(ledger=self.ledger, peers=peers, on_refused=self._report_refused)
        self.publication = Publication(self.lead, self.fleet, peers, self.telemetry)
        shared = Shared(
            cfg=cfg,
            lead=self.lead,
            ledger=self.ledger,
            fleet=self.fleet,
            peers=peers,
            history=self.history,
            telemetry=self.telemetry,
            changes=self.changes,
            clock=clock,
            wall=wall,
        )
        self.bursts = Bursts(shared=shared, tasks=tasks)
        self.executions = Executions(shared=shared, harnesses=self.harnesses, relay=self.relay)
        # The harness API's heartbeat and finish are the executions' own (see Harness API).
        self.heartbeat = self.executions.heartbeat
        self.finish = self.executions.finish
        self.transitions = TransitionRunner(
            shared=shared,
            publication=self.publication,
            supply=self.supply,
            reload_routes=self.executions.reload_routes,
        )
        self.commands = Commands(
            shared=shared, bursts=self.bursts, transitions=self.transitions, publication=self.publication
        )
        self.failures = EngineFailures(shared=shared, transitions=self.transitions)
        self.control = ControlLoop(
            shared=shared,
            policy=self.policy,
            bursts=self.bursts,
            executions=self.executions,
            supply=self.supply,
            publication=self.publication,
            transitions=self.transitions,
            commands=self.commands,
        )

    async def step_down(self, tasks: TaskSource, inputs: Mapping[str, Mapping[bytes, Any]]) -> None:
        """Stops acting and forgets everything the leadership held (its lease is gone, or a
        newer leader exists): the process is a standby again, with empty parts fed the
        watches' current ``inputs`` (cells, cell_states, policy, routers, leader); a new
        campaign's :meth:`take_over` rebuilds the rest from etcd. ``tasks``: a fresh task
        source, as a restarted process would have."""
        await self.stop()
        self._tasks = tasks
        self._build(self.lead.store, self.telemetry.events, self.telemetry.metrics)
        feeds = {
            "cells": self.on_cells,
            "cell_states": self.on_cell_states,
            "policy": self.on_policy,
            "routers": self.on_routers,
            "leader": self.on_leader,
        }
        for name, items in inputs.items():
            feeds[name](items)
        self.telemetry.emit("leader", "stepped down: leadership lost; campaigning again")

    # Shorthands (operators' and tests' vocabulary) ----------------------------------------

    @property
    def store(self) -> Store:
        return self.lead.store

    @store.setter
    def store(self, store: Store) -> None:
        self.lead.bind(store)

    @property
    def events(self) -> EventLog:
        return self.telemetry.events

    @property
    def metrics(self) -> Metrics | None:
        return self.telemetry.metrics

    @property
    def cells(self) -> CellTable:
        return self.fleet.cells

    @property
    def routes(self) -> RouteTable:
        return self.fleet.routes

    @property
    def deposed(self) -> asyncio.Event:
        return self.lead.deposed

    @property
    def leading(self) -> bool:
        return self.lead.leading

    @property
    def supply_raw(self) -> SupplyUpdate:
        return self.supply.raw

    @supply_raw.setter
    def supply_raw(self, update: SupplyUpdate) -> None:
        self.supply.raw = update

    @property
    def policy_version(self) -> int:
        return self.publication.version

    # Leadership ---------------------------------------------------------------------------

    async def take_over(self, epoch: int) -> None:
        """Rebuilds from etcd as the new leader: bursts, executions, routes, transitions,
        the policy version; then resumes what the old leader left half done."""
        stored = await self.store.load()
        self.ledger.archived = stored.summary
        for b in stored.bursts:
            self.ledger.apply_burst(b)
        self.executions.rebuild(stored.executions, stored.routes)
        policy = await self.store.read_policy()
        if policy:
            self.publication.observe(policy)
        self.lead.epoch = epoch
        c = self.ledger.counts()
        self.history.append(
            "leader", epoch, rev=epoch, dispatched=c.dispatched, launched=c.launched, finished=c.finished
        )
        self.telemetry.emit(
            "leader",
            f"elected leader at epoch {epoch}: rebuilt {len(stored.bursts)} bursts "
            f"({stored.summary.bursts} archived), "
            f"D {c.dispatched} L {c.launched} F {c.finished}, {len(self.routes.routes)} routes, "
            f"{len(stored.transitions)} transitions to resume",
        )
        for cell_id, body in stored.transitions.items():
            self.transitions.resume(cell_id, body)
        self.control.after_takeover()
        # The old leader may have died mid-publication: engines still behind catch up
        # (cells already serving the version are skipped).
        self.publication.catch_up(self.transitions.running)
        await self.changes.notify()

    # Inputs from watches ------------------------------------------------------------------

    def on_cells(self, items: Mapping[bytes, Any]) -> None:
        self.fleet.on_cells(items)
        self._cells_changed()

    def on_cell_states(self, items: Mapping[bytes, Any]) -> None:
        self.fleet.on_cell_states(items)
        self._cells_changed()

    def on_policy(self, items: Mapping[bytes, Any]) -> None:
        self.publication.on_policy(items)
        self.changes.wake()

    def on_routers(self, items: Mapping[bytes, Any]) -> None:
        self.fleet.on_routers(items)

    def on_leader(self, items: Mapping[bytes, Any]) -> None:
        self.lead.on_leader(items)

    def _cells_changed(self) -> None:
        self.fleet.settle_overlays(self.transitions.running)
        self.changes.wake()

    # Harness API --------------------------------------------------------------------------
    # ``heartbeat`` and ``finish`` are :class:`Executions`' methods, bound by ``_build``.

    async def acquire(
        self, harness_id: str, wait_s: float, key: str = ""
    ) -> tuple[Launched | None, bool, float]:
        """(launched or None, burst exhausted, retry-after hint): see Executions.acquire."""
        got = await self.executions.acquire(harness_id, wait_s, key)
        return got.launched, got.exhausted, got.retry_after_s

    async def engine_failed(self, cell_id: str, target: str, reason: str) -> tuple[bool, int]:
        """A router's engine-failure report: (dead, executions on the cell)."""
        return await self.failures.report(cell_id, target, reason)

    # Loops --------------------------------------------------------------------------------

    async def control_loop(self) -> None:
        await self.control.run()

    async def report_loop(self) -> None:
        await self.relay.run()

    def _report_refused(self, report: FinishReport, exc: Exception) -> None:
        """The packer refused a finish report (settled, not retried): recorded."""
        self.history.append(
            "report_refused",
            self.lead.epoch,
            execution_id=report.execution_id,
            group_id=report.group_id,
            error=str(exc)[:200],
        )
        self.telemetry.emit(
            "report_refused",
            f"the packer refused the finish report of {report.execution_id}: {exc}",
            execution_id=report.execution_id,
        )

    async def supply_loop(self) -> None:
        await self.supply.run(bool(self.cfg.packer_target))

    async def reconcile_once(self) -> None:
        await self.control.reconcile_once()

    async def stop(self) -> None:
        """Cancels the background work (transitions, joins, policy loads)."""
        await self.transitions.cancel_all()
        await self.publication.cancel_all()

    # Status -------------------------------------------------------------------------------

    def _reading(self) -> Reading:
        return Reading(
            self.ledger.counts(),
            self.fleet.cells.views(),
            self.supply.current,
            self.lead.leading,
            self.publication.version,
        )

    def status(self) -> SchedulerStatus:
        """GetStatus (the servicer converts it to the proto)."""
        ledger, version = self.ledger, self.publication.version
        b = ledger.current_burst
        cells = cell_statuses(self.fleet)
        return SchedulerStatus(
            epoch=self.lead.epoch,
            leader=self.lead.leading,
            policy=self.policy.name,
            burst_id=b.burst_id if b else 0,
            burst=ledger.counts(b.burst_id) if b else ledger.counts(),
            burst_by_status=ledger.finished_by_status(b.burst_id if b else None),
            total=ledger.counts(),
            total_by_status=ledger.finished_by_status(),
            capacity=capacity(self.fleet.cells.views()),
            ready_groups=self.supply.current.ready_groups,
            batch_size=self.cfg.batch_size,
            policy_version=version,
            cells=cells,
            reroutes=self.transitions.reroutes,
            bursts_completed=ledger.archived.bursts
            + sum(1 for x in ledger.bursts.values() if x.target_version <= version),
            to_training=self.commands.to_training,
            to_rollout=self.commands.to_rollout,
            versions=ledger.counts_by_version(),
            migrations=self.transitions.migrations,
            open_bursts=len(ledger.open_bursts()),
            stale_rule=self.cfg.stale_rule,
            groups_cancelled=ledger.groups_cancelled,
            groups_restamped=ledger.restamps,
            training=self.publication.training,
        )
