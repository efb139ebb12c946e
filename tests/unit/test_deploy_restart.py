"""Every deployment restarts crashed services the way the launcher does (issue 13, part 1):
compose services that run for the cluster's life say `restart: unless-stopped` and have a
healthcheck; Kubernetes workloads restart their pods (`restartPolicy: Always`) and probe
every container; the systemd unit restarts the launcher."""

from __future__ import annotations

import configparser
from pathlib import Path

import yaml

from testkit.manifests import containers, workloads

ROOT = Path(__file__).resolve().parents[2]
ONE_SHOTS = {"certs", "etcd-auth", "model", "harness"}  # run to completion, never restarted


def test_compose_restarts_and_checks_every_long_running_service():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, svc in services.items():
        if name in ONE_SHOTS:
            assert svc.get("restart") == "no", name
        elif name != "prometheus":
            assert svc.get("restart") == "unless-stopped", name
            assert svc.get("healthcheck", {}).get("test"), name


def test_kubernetes_workloads_restart_and_probe():
    for doc in workloads():
        spec = doc["spec"]["template"]["spec"]
        if doc["kind"] == "Job":
            assert spec["restartPolicy"] in ("OnFailure", "Never"), doc["metadata"]["name"]
            continue
        assert spec["restartPolicy"] == "Always", doc["metadata"]["name"]
        for c in containers(doc, init=False):
            assert "livenessProbe" in c and "readinessProbe" in c, (doc["metadata"]["name"], c["name"])


def test_systemd_unit_restarts_the_launcher_and_ends_its_processes():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "deploy" / "systemd" / "gyre-launch.service")
    service = unit["Service"]
    assert service["Restart"] in ("always", "on-failure")
    assert service["KillMode"] == "control-group"
    assert "-m apps.launch" in service["ExecStart"] and "--run-dir" in service["ExecStart"]
