"""A core whose prefix-group formation failed forms them again on the same port.

Found by the chaos demo (cell-0 SIGKILLed, then cell-1 while the restarted core formed its
groups with it): the core's first build failed (gloo could not reach the dead satellite),
and every build after it failed with EADDRINUSE on the rendezvous port, for good. The failed
build's TCPStore was still listening: the exception the service kept as the answer to
JoinBatch held the build's frames, and with them the store. The scheduler retried its
command to the core every 0.25 s and the run never ended.

Once it could bind again, the core still never met its peers: torch names the default
group from a per-process count that every ``init_process_group`` call advances, failed or
not, so the core rendezvoused as group "1", "2", ... while a fresh satellite waited under
"0".

Here the core (a TrainingService, in this process) starts while its satellite is not up:
its first formation times out. The satellite (rank 1, its own process: torch.distributed
keeps one default group per process) then starts, and the core's next build must bind the
port again (no build fails with EADDRINUSE) and form the groups with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest

from apps.model.tiny import build_tiny_model
from apps.procs import ROOT
from gyre.ports import free_port
from services.cell_agent.training.config import TrainingSettings
from services.cell_agent.training.service import TrainingService
from testkit.scheduler_peers import wait_until

pytestmark = pytest.mark.timeout(180)

SATELLITE = textwrap.dedent(
    """
    import sys
    import time
    from services.cell_agent.training.dist import PrefixGroups

    # As a satellite's TrainingService does: try again until formed (it may reach one of
    # the core's attempts as that one times out). No pause between tries: connecting waits
    # for the core's next store.
    deadline = time.monotonic() + 60
    while True:
        groups = PrefixGroups(rank=1, world_size=2, master=sys.argv[1], timeout_s=10.0)
        try:
            groups.setup()
            break
        except Exception as exc:
            if time.monotonic() > deadline:
                raise
            print("retrying", repr(exc), file=sys.stderr, flush=True)
    print("formed", groups.generation, flush=True)
    sys.stdin.read()  # stays in the world until the test closes its stdin
    groups.close()
    """
)


async def test_a_core_whose_group_formation_failed_forms_again_on_its_port(tmp_path, caplog):
    master = f"127.0.0.1:{free_port()}"
    settings = TrainingSettings(
        model_dir=str(build_tiny_model(tmp_path / "model", seed=0)),
        world_size=2,
        dist_master=master,
        dist_timeout_s=3.0,
    )
    core = TrainingService(settings, cell_id="cell-0", index=0, target="127.0.0.1:1")
    task = asyncio.create_task(core.run(retry_base_s=0.5))
    satellite = None
    try:
        # The satellite is not up: the first formation times out, and the core retries.
        await wait_until(lambda: core._failed is not None, 60, "the core's first failed build")
        satellite = subprocess.Popen(
            [sys.executable, "-c", SATELLITE, master],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        await wait_until(
            lambda: core.controller is not None or satellite.poll() is not None, 90, "the groups formed"
        )
        assert core.controller is not None, satellite.communicate(timeout=5)[1][-3000:]
        assert core._failed is None and core.groups is not None and core.groups.formations == 1
        line = await asyncio.to_thread(satellite.stdout.readline)  # type: ignore[union-attr]
        assert line.split() == ["formed", core.groups.generation]
        failures = [r.__dict__["error"] for r in caplog.records if "failed to start" in r.getMessage()]
        assert failures and not [f for f in failures if "EADDRINUSE" in f], failures
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if satellite is not None:
            satellite.kill()
            satellite.wait(10)


def test_a_formation_its_peers_abandoned_ends_within_the_formation_timeout():
    """The chaos demo's second stall: cell-1, restarted, reached the core's store as the core
    gave that formation up (cell-2 had found cell-1 dead mid-formation); the core and cell-2
    formed a new generation while cell-1 sat in the old one's rendezvous for the collective
    timeout (600 s), past the demo's end. A formation now waits for its peers no longer than
    ``form_timeout_s``; the service then builds again and finds the new generation.

    Here the store is the core's, in this process; the core never comes to the rendezvous."""
    import torch.distributed as dist

    from services.cell_agent.training.dist import PrefixGroups

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, use_libuv=True)
    store.set("gyre/gen", "abandoned")
    satellite = PrefixGroups(
        rank=1, world_size=2, master=f"127.0.0.1:{port}", timeout_s=600.0, form_timeout_s=2.0
    )
    started = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        satellite.setup()
    assert time.monotonic() - started < 60
    assert satellite.store is None and not dist.is_initialized()
