"""Every etcd Gyre deploys is kept bounded the same way: the launcher's private etcd, the
compose service and the Kubernetes StatefulSet pass the same compaction and snapshot flags
(gyre.etcd.server.UPKEEP_FLAGS). A soak found what a missing one costs: hourly compaction
grew the database 34 MB an hour, the default snapshot count etcd's RSS ~100 MB an hour."""

from __future__ import annotations

from pathlib import Path

import yaml

from gyre.etcd.server import UPKEEP_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def _compose_etcd_command() -> list[str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return [str(a) for a in compose["services"]["etcd"]["command"]]


def _k8s_etcd_args() -> list[str]:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "etcd.yaml").read_text()) if d]
    (sts,) = [d for d in docs if d.get("kind") == "StatefulSet"]
    (container,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "etcd"]
    return [str(a) for a in container["args"]]


def test_the_upkeep_flags_are_the_ones_a_long_run_needs():
    assert "--auto-compaction-retention=10m" in UPKEEP_FLAGS
    assert "--snapshot-count=10000" in UPKEEP_FLAGS


def test_compose_and_kubernetes_run_etcd_with_the_launchers_upkeep_flags():
    for where, args in (("docker-compose.yml", _compose_etcd_command()), ("deploy/k8s", _k8s_etcd_args())):
        assert args, f"{where}: no etcd arguments found"
        missing = [f for f in UPKEEP_FLAGS if f not in args]
        assert not missing, f"{where} runs etcd without {missing}"
