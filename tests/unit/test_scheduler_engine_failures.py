"""A router's engine-failure report: the leader probes the cell; a cell that does not answer
is marked down (FAILED to placement and the policy) and its executions are rerouted at once;
a cell that answers, a report about an older address, or a report to a standby change
nothing. The mark lasts until the cell registers again."""

from __future__ import annotations

import pytest

from gyre.errors import InvalidArgument, Unavailable
from services.scheduler.policy import CellState
from testkit.recording_peers import RecordingPeers
from testkit.scheduler_rig import lead, make, publish_cells, settle

CELLS = [("a", "standalone", -1, 4), ("b", "standalone", -1, 4)]


class _Peers(RecordingPeers):
    def __init__(self) -> None:
        super().__init__()
        self.dead: set[str] = set()
        self.probes: list[str] = []

    async def running_requests(self, target: str) -> int:
        self.probes.append(target)
        if target in self.dead:
            raise Unavailable(f"{target}: connection refused")
        return 0


async def _setup():
    peers = _Peers()
    s, store, _, _ = make(policy="rollout_only", cells=CELLS, peers=peers, batch_size=2)
    publish_cells(s, CELLS, {"a": 5, "b": 6})
    await lead(s, store)
    got = [await s.acquire("h", 0) for _ in range(2)]
    assert all(x[0] is not None for x in got)
    return s, peers


async def test_a_dead_engine_is_marked_down_and_its_executions_rerouted_at_once():
    s, peers = await _setup()
    counts = s.routes.counts()
    dead = max(counts, key=lambda c: counts[c])
    other = "b" if dead == "a" else "a"
    peers.dead.add(f"{dead}:1")
    assert await s.engine_failed(dead, f"{dead}:1", "stream broke: connection reset") == (True, counts[dead])
    await settle(s)
    assert s.routes.on_cell(dead) == [] and len(s.routes.on_cell(other)) == sum(counts.values())
    assert s.cells.state(dead) is CellState.FAILED  # no new work goes there
    assert any(e.kind == "engine_dead" for e in s.events.after(0))
    # A second report of the same engine does not probe again.
    probes = len(peers.probes)
    assert (await s.engine_failed(dead, f"{dead}:1", "again"))[0] is True
    assert len(peers.probes) == probes
    # The cell restarts and registers again (a new put): it takes work again.
    publish_cells(s, CELLS, {"a": 9, "b": 9})
    assert s.cells.state(dead) is CellState.ROLLOUT


async def test_an_engine_that_answers_the_probe_changes_nothing():
    s, peers = await _setup()
    before = dict(s.routes.counts())
    assert await s.engine_failed("a", "a:1", "one broken stream") == (False, before.get("a", 0))
    assert peers.probes == ["a:1"] and s.routes.counts() == before
    assert s.cells.state("a") is CellState.ROLLOUT


async def test_a_report_about_an_older_address_or_to_a_standby_changes_nothing():
    s, peers = await _setup()
    peers.dead.add("a:1")
    assert (await s.engine_failed("a", "10.0.0.9:1", "old address"))[0] is False
    assert peers.probes == [] and s.cells.state("a") is CellState.ROLLOUT
    with pytest.raises(InvalidArgument):
        await s.engine_failed("", "a:1", "no cell")
    standby, _, _, _ = make(policy="rollout_only", cells=CELLS)
    with pytest.raises(Unavailable):
        await standby.engine_failed("a", "a:1", "x")
