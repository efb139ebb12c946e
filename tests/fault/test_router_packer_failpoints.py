"""The router and the packer die at each of their transition failpoints under load (issue 13,
item 8): the short mock demo runs (real etcd, scheduler, cells, router, packer, harness on
loopback); a few seconds in, the failpoint file arms one failpoint (mode exit: status 17,
nothing flushed, like a SIGKILL) in the running process; it dies there; the file is
disarmed; the launcher's supervisor restarts it; once the restart is up, the next point of
the run is armed the same way (the router's two points share one run; each packer point has
a run of its own); the run goes on to the end.

Each run proves: the process died at each of its failpoints (exit status 17 once per point,
its log naming the point) and was restarted once per point; the run completed; every
dispatched execution finished (none lost); no episode failed (each completed or was
cancelled by the scheduler: a model call lost with its router is retried by the harness,
and that is the only retry); the history checker (``--complete``) finds every dispatched
execution closed exactly once, no group trained twice, one optimizer step per batch, no
micro-step or acknowledged record lost; and the packer's WAL holds one turn per model call
the harness got an answer to (none lost, none recorded twice).

Router failpoints (services/router):
- ``router.turn.completed``: a call's every token streamed, its turn not yet queued;
- ``router.turn.recorded``: the packer holds the turn, the call not yet ended.
Packer failpoints (services/packer: intake.py, claims.py, batches.py):
- ``packer.turn.durable`` / ``packer.finish.durable``: the record in the WAL, not answered;
- ``packer.claim.granted``: a claim in memory and the WAL buffer, not durable, not answered;
- ``packer.batch.sealed``: a batch sealed in memory, not durable, no claimer told.
``packer.turn.durable`` runs with the routers not waiting for their turns
(``router.turn_record_wait_s: 0``), so that the packer's outage outlasts the wait: harnesses
finish while the turns of their last calls are queued at the router, and after its restart
the packer hears the finish reports first. It keeps every group out of readiness for
``restart_grace_s`` after a restart, so the queued turns get in (before, 1-4 turns per kill
came too late and their groups trained without them).
One run is a demo of 60-100 s on a loaded 2-core machine, so each is marked slow (a demo
per point took 6 of them, ~7 min of the suite; 5 runs took ~6.5 min in CI, so the packer's
finish point now shares the router points' run: it comes first, at a harness's finish in
the first burst, and calls go on through both bursts after its restart).

``router.move.stopped`` (a move's source attempt stopped, the continuation not started) is
rarely reached in the demo (its calls are short: a move mostly finds an execution between
calls), so its own rig makes it happen: a real router process, the deterministic fake
engines and a recording packer stand-in, a call streaming at cell a when its route moves to
b. The router dies there; the harness's stream breaks; the router is restarted on its
address; the harness retries the call, which completes token-identical to an undisturbed
call, and the packer gets its turn exactly once (the router's history checks clean)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from apps.checker import check_files
from apps.demo.runner import run_demo
from apps.launch import Cluster
from apps.procs import ServiceProcess
from gyre.failpoints import EXIT_STATUS, FAILPOINT_FILE_ENV
from gyre.ports import free_port
from testkit.demo import restarted, short_demo
from testkit.fake_engine import FakeOptions, reference
from testkit.router_env import RouterEnv, stream_completion, stream_tokens
from testkit.router_rig import sse_token_ids, start_router

pytestmark = pytest.mark.timeout(600)

# The router's two points are hit one after the other in one run (the second armed once the
# first's restart is up): calls complete all through a run, so both come early. The packer's
# finish point goes first in that run: finishes come from the first seconds of the first
# burst, and calls go on through both bursts after its restart. The packer's claim and seal
# points each have a run of their own: they come with training, which a restart delays
# (restart_grace_s), so a later point in a sequence could come only as the run ends (CI: the
# seal point hit 3 s before the end, the run over before its restart).
ROUTER_POINTS = ["router.turn.completed", "router.turn.recorded"]
PACKER_POINTS = ["packer.claim.granted", "packer.batch.sealed"]

# The packer's turn.durable point runs with the routers not waiting for their turns and
# backing off up to 8 s (5 s by default): its outage then outlasts the wait, and after the
# restart the queued turns come seconds after the scheduler's relayed finish reports (one
# demo for both: the suite's time is near its budget). It runs alone: its router config is
# its own.
NO_WAIT = {"turn_record_wait_s": 0.0, "turn_retry_max_s": 8.0}
CASES = [
    pytest.param(["packer.finish.durable", *ROUTER_POINTS], None, id="finish-then-router-points"),
    pytest.param(["packer.turn.durable"], NO_WAIT, id="packer.turn.durable-no-wait"),
    *(pytest.param([p], None, id=p) for p in PACKER_POINTS),
]


@pytest.mark.slow
@pytest.mark.parametrize(("points", "router"), CASES)
async def test_a_service_dies_at_a_failpoint_and_nothing_is_lost(
    points: list[str], router: dict | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    armed = tmp_path / "failpoints"
    monkeypatch.setenv(FAILPOINT_FILE_ENV, str(armed))  # every service process reads it
    reached: list[str] = []

    async def arm_each(cluster: Cluster) -> None:
        await asyncio.sleep(5.0)  # into the first burst: calls, turns and claims under way
        for point in points:
            proc = cluster.procs[_victim(point)]
            pid = proc.pid
            armed.write_text(f"{point}\n")
            try:
                async with asyncio.timeout(150):
                    while proc.alive() and proc.pid == pid:
                        await asyncio.sleep(0.02)
            finally:
                armed.unlink(missing_ok=True)  # before the supervisor's restart (0.5 s back-off)
            reached.append(point)
            async with asyncio.timeout(120):  # its restart up before the next point is armed
                while not restarted(cluster, _victim(point), pid):
                    await asyncio.sleep(0.05)

    opts = short_demo(tmp_path / "demo", router=router, during=arm_each)
    summary = await run_demo(opts)
    ex = summary["executions"]
    print({k: summary.get(k) for k in ("outcome", "executions", "restarts", "reroutes", "trajectories")})
    assert reached == points, f"reached {reached} of {points}"
    # Each victim died at each of its points (status 17, and its log names the point), once
    # each, and was restarted after each.
    for victim in {_victim(p) for p in points}:
        mine = [p for p in points if _victim(p) == victim]
        exits = [e for e in summary["process_events"] if e["name"] == victim and e["kind"] == "exited"]
        assert [e["rc"] for e in exits] == [EXIT_STATUS] * len(mine), exits
        log = (opts.run_dir / "logs" / f"{victim}.log").read_text()
        for point in mine:
            assert log.count(f"failpoint {point}: exiting") == 1, point
        assert summary["restarts"].get(victim) == len(mine), summary["process_events"]
    assert summary["outcome"] == "completed", summary
    assert ex["lost"] == 0 and ex["dispatched"] == ex["finished"] == 40, ex
    assert ex["harness_failed"] == 0 and ex["harness_completed"] + ex["harness_cancelled"] == 40, ex
    verdict = summary["checker"]
    assert verdict["ok"], verdict["violations"]
    counts = verdict["counts"]
    assert counts["executions_closed"] == counts["executions_dispatched"] == 40, counts
    # No turn refused at any failpoint: none came too late, and at each router point the
    # harness's retry of a lost call had its first try's prompt (the restarted router rebuilt
    # the execution from the packer's turns; a prompt built otherwise is refused for the key).
    assert counts["turns_refused"] == counts["turns_dropped"] == 0, counts
    # The packer's WAL holds each model call the harness got an answer to once: none lost,
    # none recorded twice (a call retried after its router died included).
    assert summary["trajectories"]["turns"] == ex["harness_calls"], (summary["trajectories"], ex)
    assert json.loads((opts.run_dir / "summary.json").read_text()) == summary


def _victim(point: str) -> str:
    """The process a failpoint is in: its name's first part (``router``, ``packer``)."""
    return point.split(".")[0]


PROMPT = [40, 41, 42, 43, 44]
MAX_TOKENS = 40


async def test_router_dies_between_a_moves_stop_and_its_continuation(
    tmp_path: Path, etcd_server, cluster_name
):
    armed = tmp_path / "failpoints"
    hist = tmp_path / "router.jsonl"
    want = reference(1, PROMPT, MAX_TOKENS)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True}
    router: ServiceProcess | None = None
    async with RouterEnv(
        etcd_server.endpoint,
        tmp_path,
        cluster=cluster_name,
        engines=[FakeOptions(cell_id=cell, token_delay_s=0.02) for cell in "ab"],
        routers=0,  # started here: it dies, and its restart must have the same address
        http_port=free_port(),
        unknown_token_wait_s=20.0,
        history_file=str(hist),
    ) as env:
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(FAILPOINT_FILE_ENV, str(armed))
                router, url = await asyncio.to_thread(start_router, env.cfg, tmp_path / "router.log")
            ex, tok = await env.routed("a")

            async def move_after_6(got: list[int]) -> None:
                if len(got) >= 6 and not armed.exists():
                    armed.write_text("router.move.stopped\n")
                    await env.route(ex, "b", tok)  # the move

            got, broke = await stream_tokens(url, tok, body, move_after_6)
            assert await asyncio.to_thread(router.proc.wait, 30) == EXIT_STATUS  # it died there
            assert broke or len(got) < MAX_TOKENS, "the stream outlived its router"
            assert got == want[: len(got)]
            assert not any(e.engine.requests for e in [env.engines["b"]]), "the continuation started"
            armed.unlink()
            # The supervisor's restart, on the same address.
            router, url2 = await asyncio.to_thread(start_router, env.cfg, tmp_path / "router.log")
            assert url2 == url
            # The harness's retry, at the route's new cell.
            events = await stream_completion(url, tok, body)
            assert events[-1] == {"done": True} and not any("error" in e for e in events), events
            assert sse_token_ids(events) == want
            for _ in range(500):
                if (ex, 0) in env.packer.turns:
                    break
                await asyncio.sleep(0.02)
            assert list(env.packer.turns[(ex, 0)].output_token_ids) == want
            assert (ex, 1) not in env.packer.turns  # recorded once
            verdict = check_files([hist])
            assert verdict.ok, verdict.violations
            assert verdict.counts["turns_recorded"] == 1
        finally:
            armed.unlink(missing_ok=True)
            if router is not None:
                router.stop()
