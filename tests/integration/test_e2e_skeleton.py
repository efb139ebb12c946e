"""The walking skeleton, every service a separate process on loopback with a real etcd:
a harness gets executions from the scheduler, talks to the model through the router's
OpenAI-compatible API, the router reaches mock engines in cell agents, turn records reach
the packer, and every execution closes exactly once (dispatched = finished, none lost)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from apps.harness.env import EnvConfig
from apps.harness.example import run_harness
from apps.launch import Cluster
from gyre.grpcx.channel import dial
from gyre.identity import Role
from testkit.service_status import packer_batch, router_status, scheduler_status

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model"))


def skeleton_config(tmp_path: Path, model_dir: Path) -> Path:
    data = yaml.safe_load((ROOT / "deploy" / "local" / "cluster.yaml").read_text())
    data["cell_agent"].update(engine="mock", model_dir=str(model_dir), mock={"time_scale": 0.0}, slots=4)
    data["router"]["model_dir"] = str(model_dir)
    # One burst, no training: the thinnest path through every service.
    data["scheduler"].update(
        max_bursts=1, policy="rollout_only", batch_size=2, group_size=2, over_provision=0.0
    )
    data["packer"]["drop_zero_variance"] = False
    data["launch"]["processes"] = [
        p
        for p in data["launch"]["processes"]
        if p["service"] not in ("dashboard",) and p.get("name") not in ("cell-1", "cell-2")
    ]
    out = tmp_path / "skeleton.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


async def test_walking_skeleton(tmp_path: Path, model_dir: Path):
    cluster = Cluster(skeleton_config(tmp_path, model_dir), tmp_path / "run", free_ports=True)
    cluster.start()
    try:
        sched = cluster.procs["scheduler"].target
        stats = await run_harness(
            sched,
            EnvConfig(time_scale=0.0, turns_median=2, turns_max=3),
            concurrency=4,
            tls_dir=str(cluster.pki.identity_dir("harness")),
        )
        assert stats.failed == 0
        assert stats.completed == 4  # batch_size 2 groups x group_size 2
        operator = cluster.pki.tls("operator")  # mTLS on by default: the launcher issued it
        async with dial(sched, operator, Role.SCHEDULER) as ch:
            status = await scheduler_status(ch)
        ledger = status.ledger
        assert ledger.dispatched == ledger.finished == 4
        assert ledger.waterlevel == 0 and ledger.queued == 0 and ledger.running == 0
        async with dial(cluster.procs["router"].target, operator, Role.ROUTER) as ch:
            rstatus = await router_status(ch)
        assert rstatus.turn_records >= stats.turns
        async with dial(cluster.procs["packer"].target, operator, Role.PACKER) as ch:
            batch = await packer_batch(ch)
        assert batch.groups_packed + batch.batch_size >= 2  # the packer saw the groups
        assert not cluster.dead()
    finally:
        cluster.stop()
