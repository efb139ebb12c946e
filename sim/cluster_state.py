"""What the simulated cluster holds (:class:`ClusterState`): the cells, the trainer, the
queues and records of executions and groups, the ledgers (cumulative and per version), the
placement, the driver's hooks and every counter the metrics read. The mechanism layers over
it (``sim.decode``, ``sim.routing``, ``sim.bursts``, ``sim.training``, ``sim.roles``) change
it; ``sim.cluster`` assembles them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sim.config import CostConfig
from sim.cost import CostModel
from sim.engine import Cell, Execution, Group, VersionLedger
from sim.events import EventLoop
from sim.placement import make_placement
from sim.trainer import Trainer


@dataclass
class Ledger:
    """Cumulative D / L / F over the whole run (W counts every open execution)."""

    dispatched: int = 0
    launched: int = 0
    finished: int = 0


class ClusterState:
    """The cluster's state, shared by the mechanism's layers (one object: the hot paths read
    its attributes directly)."""

    def __init__(
        self,
        *,
        loop: EventLoop,
        cost_cfg: CostConfig,
        cells: int,
        standalone: int,
        slots: int,
        batch_groups: int,
        max_staleness: int,
        placement: str = "scheduler",
        rate_window_s: float = 600.0,
        stale_rule: str = "cancel",
        partial_max_versions: int | None = None,
    ) -> None:
        self.loop = loop
        self.cost = CostModel(cost_cfg)
        self.cc = cost_cfg
        self.cells: list[Cell] = [Cell(f"cell-{i}", i, False, slots, self.cost) for i in range(cells)]
        self.cells += [Cell(f"standalone-{j}", -1, True, slots, self.cost) for j in range(standalone)]
        self.trainer = Trainer(self.cost, batch_groups, max_staleness)
        self.ledger = Ledger()
        self.queue: deque[Execution] = deque()
        self.homeless: deque[Execution] = deque()  # launched, lost their engine, wait for a slot
        self.executions: list[Execution] = []
        self.groups: list[Group] = []
        self.published = 0
        self.on_boundary = lambda: None  # set by the driver
        self.on_update = lambda version: None
        # counters
        self.role_switches = 0
        self.switch_s = 0.0
        self.reroutes = 0
        self.reroute_recompute_tokens = 0
        self.reroute_gpu_s = 0.0  # GPU-s that reroutes cost: prefix recompute or KV handoff
        self.kv_handoffs = 0
        self.preemptions = 0  # running sequences preempted when the KV filled (recomputed)
        self.kv_evictions = 0  # cached prefixes of tool-waiting executions evicted (recomputed)
        self.kv_recompute_tokens = 0  # prefix tokens prefilled again after either
        self.kv_recompute_gpu_s = 0.0  # the GPU-s of those prefills
        self.publishes = 0
        self.sealed_batches = 0
        self.elastic = [c for c in self.cells if not c.standalone]
        self._by_id = {c.cid: c for c in self.cells}
        self.placement = make_placement(placement, self.cells)
        self.role_epoch = 0  # bumped on every role change (lets views be cached)
        # overlapping bursts: the per-version ledger, live groups, the cancel-early rule
        self.versions: dict[int, VersionLedger] = {}
        self.live: dict[int, dict[int, Group]] = {}  # version -> unconsumed, uncancelled groups
        self.stale_rule = stale_rule
        self.partial_max_versions = partial_max_versions
        self.cancelled_groups = 0
        self.cancelled_executions = 0
        self.restamped_groups = 0
        self.migrations = 0
        self.ready_log: deque[tuple[float, float]] = deque()  # (time, training work) of ready groups
        self.ready_log_tokens = 0.0
        self.rate_window_s = rate_window_s
        self.trainer.on_consumed = self._consumed

    def _consumed(self, g: Group) -> None:
        self.live.get(g.version, {}).pop(g.gid, None)
        vl = self.versions.setdefault(g.version, VersionLedger())
        vl.consumed += 1
        vl.ready -= 1
