"""Kubernetes manifests under deploy/k8s are valid and wired together.

Invariants: every manifest parses strictly (no duplicate keys) and validates against the
Kubernetes schema in strict mode (unknown fields refused; a broken twin proves the check can
fail); kustomization.yaml lists exactly the manifests it should; every workload runs a module
that exists in the repository; the topology is the one promised (scheduler 2 replicas, etcd
3 members behind a headless Service, cell agents one GPU each with the index from the pod
ordinal, a PVC for the packer's WAL, grpc.health.v1 probes on the ports the config uses);
Services select pods that exist and target ports those pods declare.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"  # oldest we target: the pod-index label needs >= 1.28
NOT_IN_KUSTOMIZATION = {"harness-job.yaml"}  # a one-off Job, applied by hand


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain YAML keeps the last silently)."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.load_all(path.read_text(), Loader=StrictLoader) if d is not None]
    assert docs, f"{path} is empty"
    return docs


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in load_all(p)]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in all_docs() if d["kind"] == kind}


def workloads() -> list[dict[str, Any]]:
    return [d for _, d in all_docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def containers(doc: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", []) if init else []) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path) -> None:
    for doc in load_all(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == "gyre", doc["metadata"]


def test_validation_can_fail() -> None:
    deployment = copy.deepcopy(by_kind("Deployment")["scheduler"])
    deployment["spec"]["template"]["spec"]["containers"][0]["grpcProbe"] = {"port": 1}  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = copy.deepcopy(by_kind("Deployment")["scheduler"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.load("a: 1\nb: 2\na: 3\n", Loader=StrictLoader)


def test_kustomization_lists_every_manifest() -> None:
    (kust,) = load_all(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization" and kust["namespace"] == "gyre"
    listed = kust["resources"]
    assert len(listed) == len(set(listed))
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization lists missing {name}"
    assert set(listed) | NOT_IN_KUSTOMIZATION == {p.name for p in manifest_files()}
    images = {i["name"] for i in kust["images"]}
    used = {c["image"].split(":")[0] for w in workloads() for c in containers(w)}
    assert used <= images, used - images


def test_every_command_names_an_existing_module() -> None:
    seen = set()
    for doc in workloads():
        for c in containers(doc):
            cmd = c.get("command") or []
            if cmd[:2] == ["sh", "-c"]:
                cmd = cmd[2].split("||")[-1].split()
            if "-m" not in cmd:
                continue
            module = cmd[cmd.index("-m") + 1]
            seen.add(module)
            parts = module.split(".")
            if parts[0] == "services":  # services/<svc>/ may land its __main__ later
                assert (ROOT / "services" / parts[1]).is_dir(), f"{doc['metadata']['name']}: no {module}"
            else:
                path = ROOT.joinpath(*parts)
                assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module
    assert {"services.scheduler", "services.router", "services.packer", "services.cell_agent",
            "services.dashboard", "apps.harness.example", "apps.model.tiny"} <= seen


def test_topology() -> None:
    deployments, statefulsets = by_kind("Deployment"), by_kind("StatefulSet")
    assert set(deployments) == {"scheduler", "router", "packer", "dashboard"}
    assert deployments["scheduler"]["spec"]["replicas"] == 2  # leader + standby

    etcd = statefulsets["etcd"]
    assert etcd["spec"]["replicas"] == 3
    headless = by_kind("Service")[etcd["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    args = " ".join(containers(etcd)[0]["args"])
    assert all(f"etcd-{i}=http://etcd-{i}." in args for i in range(3))

    for name, kind in (("cell", "elastic"), ("rollout", "standalone")):
        sts = statefulsets[name]
        (agent,) = containers(sts, init=False)
        assert agent["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        env = env_of(agent)
        assert env["GYRE_CELL_AGENT__KIND"] == kind
        assert env["GYRE_CELL_AGENT__CELL_ID"] == "$(POD_NAME)"
        if kind == "elastic":
            assert env["GYRE_CELL_AGENT__INDEX"]["fieldRef"]["fieldPath"] == (
                "metadata.labels['apps.kubernetes.io/pod-index']"
            )
        else:
            assert env["GYRE_CELL_AGENT__INDEX"] == "-1"

    packer = deployments["packer"]
    assert packer["spec"]["strategy"]["type"] == "Recreate"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in packer["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims and claims <= set(by_kind("PersistentVolumeClaim"))


def _cluster_config() -> dict[str, Any]:
    return yaml.load(by_kind("ConfigMap")["gyre-config"]["data"]["cluster.yaml"], Loader=StrictLoader)


def test_grpc_probes_match_config_ports() -> None:
    cfg = _cluster_config()
    expected = {"scheduler": cfg["scheduler"]["port"], "router": cfg["router"]["port"],
                "packer": cfg["packer"]["port"], "cell": cfg["cell_agent"]["port"],
                "rollout": cfg["cell_agent"]["port"]}
    for doc in workloads():
        name = doc["metadata"]["name"]
        if name not in expected:
            continue
        (c,) = containers(doc, init=False)
        declared = {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["grpc"]["port"] == expected[name], (name, probe)
        assert expected[name] in declared
        assert "readinessProbe" in c and "livenessProbe" in c, name


def test_services_select_existing_pods_and_ports() -> None:
    pods = [(w["spec"]["template"]["metadata"]["labels"], containers(w, init=False)) for w in workloads()]
    for name, svc in by_kind("Service").items():
        selector = svc["spec"]["selector"]
        matches = [cs for labels, cs in pods if all(labels.get(k) == v for k, v in selector.items())]
        assert matches, f"service {name} selects no pod"
        port_names = {p.get("name") for cs in matches for c in cs for p in c.get("ports", [])}
        port_numbers = {p["containerPort"] for cs in matches for c in cs for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in port_names or target in port_numbers, (name, target)


def test_configmap_is_what_pods_mount() -> None:
    cfg = _cluster_config()
    assert cfg["cluster"]["host"] == "0.0.0.0"
    assert len(cfg["cluster"]["etcd_endpoints"]) == 3
    for doc in workloads():
        for c in containers(doc, init=False):
            if "command" in c and c["command"][:3] != ["python", "-m", "apps.harness.example"]:
                assert c["command"][-2:] == ["--config", "/etc/gyre/cluster.yaml"], doc["metadata"]["name"]
                mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
                assert mounts.get("config") == "/etc/gyre"


def _selected_components(selector: dict[str, Any]) -> set[str]:
    components = {"etcd", "scheduler", "router", "packer", "cell-agent", "dashboard", "harness"}
    if not selector:
        return components
    out = set(components)
    for key, value in selector.get("matchLabels", {}).items():
        if key == "app.kubernetes.io/component":
            out &= {value}
    for expr in selector.get("matchExpressions", []):
        assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
        out &= set(expr["values"])
    return out


def test_network_policies_keep_the_inside_inside() -> None:
    """Only the scheduler, router and dashboard take connections from outside the namespace
    (and every component's metrics port); etcd, packer and cells answer the namespace only."""
    policies = by_kind("NetworkPolicy")
    assert policies, "no NetworkPolicy"
    for name, policy in policies.items():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        selected = _selected_components(spec["podSelector"])
        for rule in spec["ingress"]:
            sources = rule.get("from")
            same_namespace = sources is not None and all(set(s) == {"podSelector"} and s["podSelector"] == {}
                                                          for s in sources)
            if same_namespace:
                continue
            ports = {p["port"] for p in rule.get("ports", [])}
            assert ports, f"{name}: a rule open to outside the namespace must name its ports"
            if ports - {9100}:
                assert selected <= {"scheduler", "router", "dashboard"}, (name, selected)
                assert ports <= {50051, 50052, 8000, 8080}, (name, ports)


def test_disruption_budgets_select_workloads() -> None:
    pdbs = by_kind("PodDisruptionBudget")
    assert pdbs["etcd"]["spec"]["minAvailable"] == 2  # quorum of 3
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads()]
    for name, pdb in pdbs.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(all(labels.get(k) == v for k, v in selector.items()) for labels in pods), name
