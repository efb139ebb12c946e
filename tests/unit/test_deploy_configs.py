"""The deployment configs load into the services' own typed configs.

Invariants: for docker compose (deploy/compose/cluster.yaml + each container's environment)
and Kubernetes (the gyre-config ConfigMap + each pod's environment), every section builds
the service's pydantic config exactly as the service will at start-up (file, then
GYRE_<SECTION>__<FIELD> overrides), so a renamed or removed field breaks this test instead of
a deployment; every GYRE_ override names a real field (pydantic-settings would ignore a typo
silently); per-container identities (cell id, kind, index, advertised host) come out right;
every elastic cell gets the trainer's settings (``cell_agent.training``), standalone ones
carry them unused.
"""

from __future__ import annotations

import importlib
import os
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from gyre import config as config_mod
from gyre.config import ServiceConfig
from services.cell_agent.training.config import TrainingSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_CLUSTER = ROOT / "deploy" / "compose" / "cluster.yaml"
K8S = ROOT / "deploy" / "k8s"
LOCAL_CLUSTER = ROOT / "deploy" / "local" / "cluster.yaml"

SECTION_MODULES = {
    "scheduler": "services.scheduler.config",
    "router": "services.router.config",
    "packer": "services.packer.config",
    "cell_agent": "services.cell_agent.config",
    "dashboard": "services.dashboard.config",
}
# Overrides for fields a service is expected to grow; accepted (and ignored by
# pydantic-settings) until they exist. Empty: every override names a real field.
PENDING_FIELDS: set[str] = set()

# Which containers run which section: compose service names / Kubernetes workload names.
COMPOSE_USERS = {
    "scheduler": ["scheduler"],
    "router": ["router"],
    "packer": ["packer"],
    "cell_agent": ["cell-0", "cell-1", "cell-2", "rollout-0"],
    "dashboard": ["dashboard"],
}
K8S_USERS = {
    "scheduler": ["scheduler"],
    "router": ["router"],
    "packer": ["packer"],
    "cell_agent": ["cell", "rollout"],
    "dashboard": ["dashboard"],
}
# What the Kubernetes downward API would give a pod (for $(VAR) and fieldRef values).
FIELD_REFS = {
    "metadata.name": "{name}-1",
    "metadata.namespace": "gyre",
    "status.podIP": "10.1.2.3",
    "metadata.labels['apps.kubernetes.io/pod-index']": "1",
}


def config_class(section: str) -> type[Any]:
    module = importlib.import_module(SECTION_MODULES[section])
    classes = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, ServiceConfig) and obj.SECTION == section
    ]
    assert len(classes) == 1, f"{SECTION_MODULES[section]}: expected one config class for {section}"
    return classes[0]


def compose_env(service: str) -> dict[str, str]:
    """A compose service's environment (anchors merged by PyYAML, ${X:-d} given its default)."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    env = data["services"][service].get("environment") or {}
    out = {}
    for key, value in env.items():
        out[key] = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))
    return out


def k8s_workload(name: str) -> dict[str, Any]:
    for path in K8S.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no workload {name}")


def k8s_env(name: str) -> dict[str, str]:
    """A pod's environment as the kubelet would resolve it (downward API, $(VAR) references)."""
    (container,) = k8s_workload(name)["spec"]["template"]["spec"]["containers"]
    out: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            value = FIELD_REFS[item["valueFrom"]["fieldRef"]["fieldPath"]].format(name=name)
        else:
            value = re.sub(r"\$\(([A-Z_]+)\)", lambda m: out[m.group(1)], item["value"])
        out[item["name"]] = value
    return out


def k8s_cluster_yaml() -> str:
    doc = yaml.safe_load((K8S / "configmap.yaml").read_text())
    return doc["data"]["cluster.yaml"]


TOOL_VARIABLES = {"GYRE_CONFIG", "GYRE_HEALTHCHECK_TLS_DIR", "GYRE_HARNESS_TLS_DIR"}
"""Variables read by tools in the container (the config file, the healthcheck's and the
harness's identity), not section overrides."""


def has_field(cls: type[Any], path: list[str]) -> bool:
    """Whether ``GYRE_<SECTION>__A__B`` names a field: ``a`` of ``cls``, then ``b`` of the
    model (or of one of the models of a union) that ``a`` holds."""
    if not path:
        return True
    field = cls.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    return any(has_field(m, path[1:]) for m in models_in(field.annotation))


def models_in(annotation: Any) -> list[type[Any]]:
    """The pydantic models an annotation can hold (through Optional, unions, Annotated)."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def build(
    section: str, text: str, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Any:
    cls = config_class(section)
    prefix = f"GYRE_{section.upper()}__"
    for key in list(os.environ):
        if key.startswith("GYRE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(prefix):
            field = key[len(prefix) :].lower()
            assert has_field(cls, field.split("__")) or field in PENDING_FIELDS, (
                f"{key}: {cls.__name__} has no field {field}"
            )
        elif key.startswith("GYRE_") and key not in TOOL_VARIABLES:
            raise AssertionError(f"{key} overrides another section than {section}")
        monkeypatch.setenv(key, value)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return config_mod.load(cls, path)


def test_every_section_is_known() -> None:
    for text in (COMPOSE_CLUSTER.read_text(), k8s_cluster_yaml()):
        sections = set(yaml.safe_load(text))
        assert sections - {"cluster"} <= set(SECTION_MODULES), sections


@pytest.mark.parametrize("section", sorted(COMPOSE_USERS))
def test_compose_sections_load(section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for service in COMPOSE_USERS[section]:
        cfg = build(section, COMPOSE_CLUSTER.read_text(), compose_env(service), tmp_path, monkeypatch)
        assert cfg.cluster_name == "compose" and cfg.etcd_endpoints == ["etcd:2379"]
        assert cfg.host == "0.0.0.0"
        if section == "cell_agent":
            assert cfg.cell_id == service and cfg.advertise_host == service  # type: ignore[attr-defined]
            assert cfg.kind == ("standalone" if service.startswith("rollout") else "elastic")  # type: ignore[attr-defined]
            assert cfg.index == (-1 if cfg.kind == "standalone" else int(service[-1]))  # type: ignore[attr-defined]
            assert cfg.engine == "mock"  # type: ignore[attr-defined]
            assert isinstance(cfg.training, TrainingSettings) and cfg.training.world_size == 3  # type: ignore[attr-defined]
        elif section != "dashboard":
            assert cfg.advertise_host == service


@pytest.mark.parametrize("section", sorted(K8S_USERS))
def test_k8s_sections_load(section: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for workload in K8S_USERS[section]:
        cfg = build(section, k8s_cluster_yaml(), k8s_env(workload), tmp_path, monkeypatch)
        assert cfg.cluster_name == "gyre" and len(cfg.etcd_endpoints) == 3
        assert cfg.host == "0.0.0.0"
        if section == "cell_agent":
            assert cfg.cell_id == f"{workload}-1"  # type: ignore[attr-defined]
            assert cfg.index == (-1 if workload == "rollout" else 1)  # type: ignore[attr-defined]
            assert cfg.kind == ("standalone" if workload == "rollout" else "elastic")  # type: ignore[attr-defined]
            assert isinstance(cfg.training, TrainingSettings) and cfg.training.world_size == 3  # type: ignore[attr-defined]
        if section != "dashboard":
            assert cfg.advertise_host == "10.1.2.3"


def test_a_typo_in_an_override_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(compose_env("dashboard"), GYRE_DASHBOARD__POLL_INTERVAL=1)
    with pytest.raises(AssertionError, match="no field poll_interval"):
        build(
            "dashboard",
            COMPOSE_CLUSTER.read_text(),
            {k: str(v) for k, v in env.items()},
            tmp_path,
            monkeypatch,
        )
    env = dict(compose_env("cell-0"), GYRE_CELL_AGENT__TRAINING__LEARNING_RATE="0.1")
    with pytest.raises(AssertionError, match="no field training__learning_rate"):
        build("cell_agent", COMPOSE_CLUSTER.read_text(), env, tmp_path, monkeypatch)
    env = dict(compose_env("cell-0"), GYRE_CELL_AGENT__TRAINING__LR="0.1")  # a real nested field
    assert build("cell_agent", COMPOSE_CLUSTER.read_text(), env, tmp_path, monkeypatch).training.lr == 0.1
    bad = COMPOSE_CLUSTER.read_text().replace(
        "poll_interval_s: 0.5", "poll_interval_s: 0.5\n  poll_every_s: 1"
    )
    with pytest.raises(ValueError, match="poll_every_s"):
        build("dashboard", bad, {}, tmp_path, monkeypatch)


def _compose_elastic() -> list[str]:
    return [
        name
        for name in COMPOSE_USERS["cell_agent"]
        if compose_env(name)["GYRE_CELL_AGENT__KIND"] == "elastic"
    ]


def test_sections_agree_with_each_other() -> None:
    """Values that two sections (or a section and the topology) must share."""
    compose = yaml.safe_load(COMPOSE_CLUSTER.read_text())
    k8s = yaml.safe_load(k8s_cluster_yaml())
    cell_sts = k8s_workload("cell")
    for cfg, packer_host, elastic, core_host in (
        (compose, "packer", len(_compose_elastic()), "cell-0"),
        (
            k8s,
            "packer.gyre.svc.cluster.local",
            cell_sts["spec"]["replicas"],
            "cell-0.cell.gyre.svc.cluster.local",
        ),
    ):
        assert cfg["scheduler"]["batch_size"] == cfg["packer"]["batch_size"]
        packer = f"{packer_host}:{cfg['packer']['port']}"
        assert cfg["scheduler"]["packer_target"] == cfg["router"]["packer_target"] == packer
        training = cfg["cell_agent"]["training"]
        assert training["packer_target"] == packer
        assert training["world_size"] == elastic  # every elastic cell is one rank
        host, _, port = training["dist_master"].rpartition(":")
        assert host == core_host and port == "29500"
        assert cfg["dashboard"]["scheduler_target"].endswith(f":{cfg['scheduler']['port']}")
    assert compose_env("cell-0")["GYRE_CELL_AGENT__INDEX"] == "0"  # the rendezvous host is the core
    (agent,) = cell_sts["spec"]["template"]["spec"]["containers"]
    assert 29500 in {p["containerPort"] for p in agent["ports"]}
    assert cell_sts["spec"]["serviceName"] == "cell"


def _shipped_cluster_files(tmp_path: Path) -> list[Path]:
    """Every shipped cluster config (compose, Kubernetes's ConfigMap, local) as a file under
    ``tmp_path``, as the launcher would load it."""
    paths = []
    for name, text in (
        ("compose", COMPOSE_CLUSTER.read_text()),
        ("k8s", k8s_cluster_yaml()),
        ("local", LOCAL_CLUSTER.read_text()),
    ):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        paths.append(path)
    return paths


def test_the_longest_segment_fits_a_micro_step(tmp_path: Path) -> None:
    """Every shipped config trains its longest trajectory segment (apps/limits.py); a budget
    below it is refused when the config is loaded."""
    from apps.limits import check_sequence_limits

    for path in _shipped_cluster_files(tmp_path):
        assert check_sequence_limits(path) >= 2048
    doc = yaml.safe_load(LOCAL_CLUSTER.read_text())
    doc["packer"]["micro_step_token_budget"] = 1024
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="micro_step_token_budget"):
        check_sequence_limits(path)


def test_scheduler_and_packer_agree_on_the_staleness_bound(tmp_path: Path) -> None:
    """Every shipped config sets eta once for both services; a config where they differ is
    refused when the launcher loads it."""
    from apps.limits import check_shared_settings

    for path in _shipped_cluster_files(tmp_path):
        check_shared_settings(path)
    doc = yaml.safe_load(LOCAL_CLUSTER.read_text())
    doc.setdefault("cluster", {})["max_staleness"] = 2
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(doc))
    check_shared_settings(path)  # once, in cluster: both services read it
    doc["packer"]["max_staleness"] = 0
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="max_staleness"):
        check_shared_settings(path)
