"""Stand-in scheduler peers in memory: cell agents, routers and the packer answer at once and
every command is recorded. The scheduler ledger benchmark runs the real scheduler and etcd
against them (so it measures the scheduler, not its peers); unit tests script them to fail
a number of calls or to hold a state change.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gyre.errors import Unavailable
from services.scheduler.peers import FinishReport, MoveOrder, SupplyUpdate
from services.scheduler.policy import CellState


class RecordingPeers:
    """Cell agents, routers and the packer, in memory. ``states`` is what agents would write."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.states: dict[str, CellState] = {}
        self.reports: dict[str, FinishReport] = {}
        self.report_failures = 0
        self.running: dict[str, int] = {}
        self.batch_id = 1
        self.supply: asyncio.Queue[SupplyUpdate] = asyncio.Queue()
        self.fail_commands = 0
        self.hold_set_state: asyncio.Event | None = None
        self.on_state: Any = None

    async def report_finish(self, report: FinishReport) -> None:
        if self.report_failures > 0:
            self.report_failures -= 1
            raise Unavailable("packer down (fake)")
        self.reports[report.execution_id] = report

    async def watch_supply(self) -> AsyncIterator[SupplyUpdate]:
        while True:
            yield await self.supply.get()

    async def current_batch(self) -> int:
        return self.batch_id

    async def seal_batch(self, epoch: int, batch_id: int) -> None:
        self.calls.append(("seal_batch", (epoch, batch_id)))

    async def set_state(self, target: str, epoch: int, state: CellState, reason: str) -> CellState:
        if self.hold_set_state is not None:
            await self.hold_set_state.wait()
        if self.fail_commands > 0:
            self.fail_commands -= 1
            raise Unavailable("cell agent unreachable (fake)")
        self.calls.append(("set_state", (target, epoch, state)))
        self.states[target] = state
        if self.on_state is not None:
            self.on_state(target, state)
        return state

    async def load_policy(self, target: str, epoch: int, version: int, source_target: str) -> int:
        self.calls.append(("load_policy", (target, epoch, version, source_target)))
        return version

    async def join_batch(
        self, target: str, epoch: int, batch_id: int, policy_version: int, prefix_size: int, core_target: str
    ) -> bool:
        self.calls.append(("join_batch", (target, epoch, batch_id, policy_version, prefix_size, core_target)))
        return True

    async def running_requests(self, target: str) -> int:
        return self.running.get(target, 0)

    async def move_executions(
        self, router_targets: Sequence[str], epoch: int, moves: Sequence[MoveOrder]
    ) -> int:
        self.calls.append(("move_executions", (tuple(router_targets), epoch, tuple(moves))))
        return 0

    async def close(self) -> None:
        return None

    def commands(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]
