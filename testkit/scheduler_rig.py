"""The scheduler against in-memory fakes of etcd and its peers: ``make`` builds a scheduler
on a :class:`FakeStore`, :class:`RecordingPeers` and a manual clock, with three cells whose
agents answer role commands at once; ``lead`` takes over and dispatches the first burst;
``settle`` waits for the transitions in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import json
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
    s.on_cells(
        {
            f"/c/{cid}".encode(): KV(
                f"/c/{cid}".encode(),
                json.dumps(
                    {"cell_id": cid, "kind": kind, "index": idx, "slots": slots, "target": f"{cid}:1"}
                ).encode(),
            )
            for cid, kind, idx, slots in cells
        }
    )
    states = {cid: CellState.ROLLOUT for cid, *_ in cells}

    def publish_states() -> None:
        s.on_cell_states(
            {
                f"/s/{cid}".encode(): KV(f"/s/{cid}".encode(), json.dumps({"state": st.value}).encode())
                for cid, st in states.items()
            }
        )

    def on_state(target: str, state: CellState) -> None:  # the agent writes its state key
        states[target.split(":")[0]] = state
        publish_states()

    peers.on_state = on_state
    publish_states()
    return s, store, peers, clock


async def lead(s: Scheduler, store: FakeStore) -> None:
    await s.take_over(store.epoch)
    await s.reconcile_once()  # dispatches the first burst


async def settle(s: Scheduler) -> None:
    for _ in range(500):
        if not any(s.transitions.running(c) for c in [*s.cells.records, *s.routes.counts()]):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("transition did not finish")
