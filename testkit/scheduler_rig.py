"""The scheduler against in-memory fakes of etcd and its peers: ``make`` builds a scheduler
on a :class:`FakeStore`, :class:`RecordingPeers` and a manual clock, with three cells whose
agents answer role commands at once; ``lead`` takes over and dispatches the first burst;
``settle`` waits for the transitions in flight, ``reconciled`` reconciles once and settles;
``publish_cells`` / ``publish_states`` / ``publish_policy`` deliver what etcd's watches
would (cell registrations, cell state keys, a policy record)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from gyre import config as config_mod
from services.scheduler.config import SchedulerConfig
from services.scheduler.policy import CellState
from services.scheduler.scheduler import Scheduler
from services.scheduler.tasks import GeneratedTasks
from testkit.clock import ManualClock
from testkit.recording_peers import RecordingPeers
from testkit.scheduler_fakes import FakeStore


@dataclasses.dataclass
class KV:
    key: bytes
    value: bytes
    mod_revision: int = 0


CELLS = [
    # id, kind, index, slots
    ("core", "elastic", 0, 4),
    ("sat1", "elastic", 1, 4),
    ("sa", "standalone", -1, 8),
]


def make(
    policy: str = "waterlevel",
    cells: list[tuple[str, str, int, int]] = CELLS,
    store: FakeStore | None = None,
    peers: RecordingPeers | None = None,
    clock: ManualClock | None = None,
    **overrides: Any,
) -> tuple[Scheduler, FakeStore, RecordingPeers, ManualClock]:
    opts = dict(
        policy=policy,
        batch_size=4,
        group_size=2,
        over_provision=0.0,
        interval_s=0.0,
        fraction=0.5,
        heartbeat_deadline_s=10.0,
        drain_timeout_s=1.0,
        packer_target="fake:1",
        router_target="router:1",
    )
    opts.update(overrides)
    cfg = config_mod.load(SchedulerConfig, None, **opts)
    store = store or FakeStore(epoch=7)
    peers = peers or RecordingPeers()
    clock = clock or ManualClock()
    s = Scheduler(config=cfg, store=store, peers=peers, tasks=GeneratedTasks(seed=1), clock=clock, wall=clock)
    publish_cells(s, cells)
    states = {cid: CellState.ROLLOUT for cid, *_ in cells}

    def on_state(target: str, state: CellState) -> None:  # the agent writes its state key
        states[target.split(":")[0]] = state
        publish_states(s, states)

    peers.on_state = on_state
    publish_states(s, states)
    return s, store, peers, clock


def publish_cells(
    s: Scheduler, cells: list[tuple[str, str, int, int]], revisions: Mapping[str, int] | None = None
) -> None:
    """The registrations of ``cells`` (id, kind, index, slots; address ``<id>:1``), each key
    at its ``revisions`` entry (0 without), as the cells watch delivers them."""
    s.on_cells(
        {
            f"/c/{cid}".encode(): KV(
                f"/c/{cid}".encode(),
                json.dumps(
                    {"cell_id": cid, "kind": kind, "index": idx, "slots": slots, "target": f"{cid}:1"}
                ).encode(),
                (revisions or {}).get(cid, 0),
            )
            for cid, kind, idx, slots in cells
        }
    )


def publish_states(s: Scheduler, states: Mapping[str, CellState]) -> None:
    """The state keys of the cells in ``states``, as the cell states watch delivers them."""
    s.on_cell_states(
        {
            f"/s/{cid}".encode(): KV(f"/s/{cid}".encode(), json.dumps({"state": st.value}).encode())
            for cid, st in states.items()
        }
    )


def publish_policy(s: Scheduler, version: int, source: str = "core:1") -> None:
    """The policy record of ``version``, published by the trainer at ``source``."""
    s.on_policy({b"p": KV(b"p", json.dumps({"version": version, "source_target": source}).encode())})


async def lead(s: Scheduler, store: FakeStore) -> None:
    await s.take_over(store.epoch)
    await s.reconcile_once()  # dispatches the first burst


async def settle(s: Scheduler) -> None:
    for _ in range(500):
        if not any(s.transitions.running(c) for c in [*s.cells.records, *s.routes.counts()]):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("transition did not finish")


async def reconciled(s: Scheduler) -> None:
    """One reconcile, then the transitions it started settle."""
    await s.reconcile_once()
    await settle(s)
