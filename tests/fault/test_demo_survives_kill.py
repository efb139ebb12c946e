"""`make demo` goes on when a process is SIGKILLed (issue 13, part 1): the short mock demo
of tests/integration/test_e2e_demo.py with a process SIGKILLed mid-run; the launcher
restarts it, it rejoins, and the run completes with nothing lost.

The victims: the training core's cell agent (cell-0) and a satellite's (cell-1), in one run
one after the other (cell-1 once cell-0's restart is up: each dies, is restarted once and
rejoins). The scheduler is SIGKILLed first in the chaos demo (test_chaos_demo.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from apps.demo.runner import run_demo
from apps.launch import Cluster
from testkit.demo import restarted, short_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# The scheduler, the router and the packer are SIGKILLed mid-run by the chaos demo
# (test_chaos_demo.py), and the router and the packer die at every failpoint of theirs in a
# demo (test_router_packer_failpoints.py): a demo each here too would only repeat those (the
# suite's time is near its 30 min budget). The two cell agents die in one run, one after the
# other (a demo each cost ~60 s).
async def test_demo_completes_when_a_cell_agent_is_sigkilled(tmp_path: Path):
    victims = ["cell-0", "cell-1"]
    killed: list[str] = []

    async def kill_each(cluster: Cluster) -> None:
        await asyncio.sleep(8.0)  # into the first burst: executions are live on every cell
        for victim in victims:
            pid = cluster.procs[victim].pid
            os.kill(pid, signal.SIGKILL)
            killed.append(victim)
            async with asyncio.timeout(120):  # restarted (a new process, ready) before the next
                while not restarted(cluster, victim, pid):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)  # it rejoins (the chaos demo's gap between faults)

    opts = short_demo(tmp_path / "demo", during=kill_each)
    summary = await run_demo(opts)
    print(
        {
            k: summary[k]
            for k in (
                "outcome",
                "executions",
                "restarts",
                "bursts",
                "reroutes",
                "policy_versions_published",
                "transitions_to_training",
                "process_events",
            )
        }
    )
    assert killed == victims, f"the faults injected: {killed} of {victims}"
    assert summary["outcome"] == "completed", summary
    ex = summary["executions"]
    assert ex["lost"] == 0 and ex["dispatched"] == ex["finished"] > 0, ex
    for victim in victims:
        assert summary["restarts"].get(victim) == 1, (victim, summary["process_events"])
    # Every planned task ran: 2 bursts' worth, which the asynchronous policy may dispatch as
    # one burst (the demo then ends on its work, not on the burst count).
    assert summary["bursts"] >= 1 and ex["dispatched"] == 40, summary
