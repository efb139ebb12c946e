"""A dead engine is noticed in about a second: a cell agent serving a live model stream is
SIGKILLed; the router reports the failure, the scheduler probes the cell, finds it dead and
reroutes its executions at once, and the router continues the call at the destination: the
harness's gRPC stream completes without error, with every token it asked for. Real
scheduler, router and cell agents (mock engines) as processes on a real etcd, with the
default lease TTL (10 s): without the report the reroute would wait for the lease to lapse
(the negative twin shows that wait)."""

from __future__ import annotations

import secrets

import pytest

from testkit.reroute_rig import RerouteRig
from testkit.tls import PKI

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("report", [True, False], ids=["reported", "lease-only"])
async def test_sigkilled_engine_mid_stream_the_harness_stream_completes(fresh_etcd, tmp_path, report):
    rig = RerouteRig(tmp_path, fresh_etcd.endpoint, PKI, "rr" + secrets.token_hex(4), report=report)
    await rig.start(cells=2)
    try:
        trial = await rig.trial(max_tokens=300, kill_after=40)
        assert trial.error == ""  # one unbroken response
        assert trial.tokens == 300
        assert trial.destination != trial.source and trial.reroutes >= 1
        if report:
            assert trial.gap_s < 5.0, trial  # about a second (loose: a loaded 2-core machine)
        else:
            assert trial.gap_s > 5.0, trial  # the lease (10 s) had to lapse first
    finally:
        await rig.stop()
