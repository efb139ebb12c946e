"""Kubernetes manifests under deploy/k8s are valid and wired together.

Invariants: every manifest parses strictly (no duplicate keys) and validates against the
Kubernetes schema in strict mode (unknown fields refused; a broken twin proves the check can
fail); kustomization.yaml lists exactly the manifests it should; every workload runs a module
that exists in the repository; the topology is the one promised (scheduler 2 replicas, etcd
3 members behind a headless Service, cell agents one GPU each with the index from the pod
ordinal, a PVC for the packer's WAL, grpc.health.v1 probes on the plaintext health port the
config gives every service); Services select pods that exist and target ports those pods
declare. Security (issue 14): every Gyre workload mounts its own identity where the config's
tls.dir points (a cert-manager Certificate's Secret, or a per-pod csi certificate for cells
whose CN is the pod name), every Certificate names its role and name the way Gyre reads them,
etcd serves TLS with client-certificate users, and the NetworkPolicies, evaluated as the API
server would, let Gyre's services reach etcd and each other while the harness reaches only
the scheduler's and the router's harness-facing ports.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from testkit.manifests import (
    K8S,
    PROMISED_MODULES,
    StrictLoader,
    by_kind,
    containers,
    env_of,
    load_all,
    manifest_files,
    module_exists,
    python_module,
    workloads,
)

K8S_VERSION = "1.30"  # oldest we target: the pod-index label needs >= 1.28
NOT_IN_KUSTOMIZATION = {"harness-job.yaml"}  # a one-off Job, applied by hand


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path) -> None:
    for doc in load_all(path):
        if doc["apiVersion"].startswith("cert-manager.io/"):
            validate_cert_manager(doc)  # a CRD: not in the Kubernetes schema
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == "gyre", doc["metadata"]


CERT_FIELDS = {
    "secretName",
    "issuerRef",
    "commonName",
    "subject",
    "dnsNames",
    "ipAddresses",
    "usages",
    "privateKey",
    "duration",
    "renewBefore",
    "isCA",
}


def validate_cert_manager(doc: dict[str, Any]) -> None:
    """The fields Gyre uses of cert-manager's Issuer and Certificate (v1), strictly."""
    assert doc["apiVersion"] == "cert-manager.io/v1", doc["apiVersion"]
    spec = doc["spec"]
    if doc["kind"] == "Issuer":
        assert set(spec) in ({"selfSigned"}, {"ca"}), spec
        if "ca" in spec:
            assert set(spec["ca"]) == {"secretName"}
        return
    assert doc["kind"] == "Certificate", doc["kind"]
    assert set(spec) <= CERT_FIELDS, set(spec) - CERT_FIELDS
    assert {"secretName", "issuerRef", "commonName"} <= set(spec)
    assert set(spec["issuerRef"]) <= {"name", "kind", "group"} and spec["issuerRef"]["kind"] in (
        "Issuer",
        "ClusterIssuer",
    )
    assert set(spec.get("subject", {})) <= {"organizations", "organizationalUnits"}
    assert set(spec.get("privateKey", {})) <= {"algorithm", "size", "rotationPolicy", "encoding"}
    assert set(spec.get("usages", [])) <= {
        "server auth",
        "client auth",
        "digital signature",
        "key encipherment",
        "cert sign",
        "crl sign",
    }


def test_certificates_name_roles_the_way_gyre_reads_them() -> None:
    from gyre.identity import Identity, Role

    certs = {n: c for n, c in by_kind("Certificate").items() if not c["spec"].get("isCA")}
    issuers = by_kind("Issuer")
    assert {
        "gyre-scheduler",
        "gyre-router",
        "gyre-packer",
        "gyre-dashboard",
        "gyre-harness",
        "gyre-operator",
        "gyre-root",
        "gyre-etcd",
    } <= set(certs)
    for name, c in certs.items():
        spec = c["spec"]
        (ou,) = spec["subject"]["organizationalUnits"]
        who = Identity(Role.parse(ou), spec["commonName"])  # valid names, reserved names respected
        assert spec["secretName"] == f"gyre-tls-{who.name}" and spec["issuerRef"]["name"] in issuers
        assert {who.name, who.role.value} <= set(spec["dnsNames"]), name  # clients check the role
        assert {"server auth", "client auth"} <= set(spec["usages"]), name
    assert set(certs["gyre-etcd"]["spec"]["dnsNames"]) >= {"*.etcd-peers.gyre.svc.cluster.local"}
    ca = by_kind("Certificate")["gyre-ca"]["spec"]
    assert ca["isCA"] and issuers["gyre-ca"]["spec"]["ca"]["secretName"] == ca["secretName"]


def test_every_gyre_workload_mounts_its_identity() -> None:
    cfg = _cluster_config()
    tls_dir = cfg["cluster"]["tls"]["dir"]
    assert not cfg["cluster"]["tls"].get("insecure")
    expected = {
        "scheduler": "gyre-tls-scheduler",
        "router": "gyre-tls-router",
        "packer": "gyre-tls-packer",
        "dashboard": "gyre-tls-dashboard",
        "harness": "gyre-tls-harness",
        "etcd-auth": "gyre-tls-root",
        "cell": "csi",
        "rollout": "csi",
    }
    certs = {c["spec"]["secretName"] for c in by_kind("Certificate").values()}
    for doc in workloads():
        name = doc["metadata"]["name"]
        if name == "etcd":
            continue
        (c,) = containers(doc, init=False)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts.get("tls") == tls_dir, name
        vols = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        if expected[name] == "csi":
            attrs = vols["tls"]["csi"]["volumeAttributes"]
            assert attrs["csi.cert-manager.io/common-name"] == "${POD_NAME}"  # the cell id
            assert attrs["csi.cert-manager.io/organizationalunits"] == "cell-agent"
            assert "cell-agent" in attrs["csi.cert-manager.io/dns-names"].split(",")
            assert env_of(c)["GYRE_CELL_AGENT__CELL_ID"] == "$(POD_NAME)"
        else:
            assert vols["tls"]["secret"]["secretName"] == expected[name] and expected[name] in certs, name
    etcd = by_kind("StatefulSet")["etcd"]
    args = containers(etcd)[0]["args"]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    assert not any("http://0.0.0.0:2379" in a for a in args)
    job = by_kind("Job")["etcd-auth"]
    provisioned = containers(job)[0]["command"]
    for sts in ("cell", "rollout"):
        for i in range(by_kind("StatefulSet")[sts]["spec"]["replicas"]):
            assert f"cell-agent/{sts}-{i}" in provisioned  # every cell has its etcd user


def test_validation_can_fail() -> None:
    with pytest.raises(AssertionError):
        bad = copy.deepcopy(by_kind("Certificate")["gyre-scheduler"])
        bad["spec"]["commonNme"] = "typo"
        validate_cert_manager(bad)
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
            module = python_module(c.get("command") or [])
            if module is None:
                continue
            seen.add(module)
            assert module_exists(module), f"{doc['metadata']['name']}: no {module}"
    assert PROMISED_MODULES <= seen


def test_topology() -> None:
    deployments, statefulsets = by_kind("Deployment"), by_kind("StatefulSet")
    assert set(deployments) == {"scheduler", "router", "packer", "dashboard"}
    assert deployments["scheduler"]["spec"]["replicas"] == 2  # leader + standby
    assert deployments["router"]["spec"]["replicas"] >= 2  # routers scale out behind one Service

    etcd = statefulsets["etcd"]
    assert etcd["spec"]["replicas"] == 3
    headless = by_kind("Service")[etcd["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    args = " ".join(containers(etcd)[0]["args"])
    assert all(f"etcd-{i}=https://etcd-{i}." in args for i in range(3))

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
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in packer["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims and claims <= set(by_kind("PersistentVolumeClaim"))


def _cluster_config() -> dict[str, Any]:
    return yaml.load(by_kind("ConfigMap")["gyre-config"]["data"]["cluster.yaml"], Loader=StrictLoader)


def test_grpc_probes_match_config_ports() -> None:
    # The kubelet's gRPC probes cannot do TLS: they probe the plaintext health-only port.
    cfg = _cluster_config()
    health = cfg["cluster"]["health_port"]
    expected = {
        "scheduler": cfg["scheduler"]["port"],
        "router": cfg["router"]["port"],
        "packer": cfg["packer"]["port"],
        "cell": cfg["cell_agent"]["port"],
        "rollout": cfg["cell_agent"]["port"],
    }
    for doc in workloads():
        name = doc["metadata"]["name"]
        if name not in expected:
            continue
        (c,) = containers(doc, init=False)
        declared = {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["grpc"]["port"] == health, (name, probe)
        assert {expected[name], health} <= declared
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
            if "command" in c and c["command"][:3] not in (
                ["python", "-m", "apps.harness.example"],
                ["python", "-m", "gyre.etcd.access"],
            ):
                assert c["command"][-2:] == ["--config", "/etc/gyre/cluster.yaml"], doc["metadata"]["name"]
                mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
                assert mounts.get("config") == "/etc/gyre"


OUTSIDE = "outside"  # a pod in another namespace (an operator's tool, Prometheus, a remote harness)


def _selects(selector: dict[str, Any], component: str) -> bool:
    labels = {"app.kubernetes.io/component": component, "app.kubernetes.io/name": "gyre"}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _peer_matches(peer: dict[str, Any], source: str) -> bool:
    """A NetworkPolicy peer (a from/to entry) against a pod of ``source`` (in the namespace)
    or OUTSIDE."""
    if "namespaceSelector" in peer:
        if source == OUTSIDE:
            return "podSelector" not in peer
        return "podSelector" not in peer or _selects(peer["podSelector"], source)
    return source != OUTSIDE and _selects(peer["podSelector"], source)


def _rules_allow(rules: list[dict[str, Any]], key: str, other: str, port: int) -> bool:
    for rule in rules:
        peers = rule.get(key)
        if peers is not None and not any(_peer_matches(p, other) for p in peers):
            continue
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        return True
    return False


def allowed(source: str, dest: str, port: int) -> bool:
    """Whether the policies let ``source`` connect to ``dest``:``port`` (ingress at the
    destination and egress at the source, as Kubernetes combines them)."""
    policies = list(by_kind("NetworkPolicy").values())
    ingress = [
        p
        for p in policies
        if "Ingress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], dest)
    ]
    if ingress and not any(_rules_allow(p["spec"].get("ingress", []), "from", source, port) for p in ingress):
        return False
    if source == OUTSIDE:
        return True
    egress = [
        p
        for p in policies
        if "Egress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], source)
    ]
    return not egress or any(_rules_allow(p["spec"].get("egress", []), "to", dest, port) for p in egress)


def test_network_policies_keep_the_inside_inside() -> None:
    """Gyre's services reach etcd and each other; the harness reaches only the harness-facing
    ports of the scheduler and the router; from outside, only those, the dashboard and the
    metrics ports."""
    cfg = _cluster_config()
    sched, router, packer, cell = (
        cfg["scheduler"]["port"],
        cfg["router"]["port"],
        cfg["packer"]["port"],
        cfg["cell_agent"]["port"],
    )
    http = cfg["router"]["http_port"]
    services = ("scheduler", "router", "packer", "cell-agent")
    for src in services:
        assert allowed(src, "etcd", 2379), src
    assert allowed("etcd-auth", "etcd", 2379) and allowed("etcd", "etcd", 2380)
    assert allowed("scheduler", "cell-agent", cell) and allowed("scheduler", "router", router)
    assert allowed("scheduler", "packer", packer) and allowed("router", "cell-agent", cell)
    assert allowed("router", "packer", packer) and allowed("cell-agent", "packer", packer)
    assert allowed("cell-agent", "cell-agent", 29500) and allowed("dashboard", "scheduler", sched)
    # The harness: exactly its two doors.
    assert allowed("harness", "scheduler", sched) and allowed("harness", "router", router)
    assert allowed("harness", "router", http)
    for dest, port in (
        ("etcd", 2379),
        ("packer", packer),
        ("cell-agent", cell),
        ("cell-agent", 29500),
        ("dashboard", cfg["dashboard"]["http_port"]),
        ("scheduler", 9100),
        ("router", 9100),
    ):
        assert not allowed("harness", dest, port), (dest, port)
    # From outside the namespace.
    for dest, port in (("etcd", 2379), ("packer", packer), ("cell-agent", cell), ("cell-agent", 29500)):
        assert not allowed(OUTSIDE, dest, port), (dest, port)
    assert allowed(OUTSIDE, "scheduler", sched) and allowed(OUTSIDE, "router", http)
    assert allowed(OUTSIDE, "packer", 9100) and not allowed(OUTSIDE, "etcd", 9100)


def test_disruption_budgets_select_workloads() -> None:
    pdbs = by_kind("PodDisruptionBudget")
    assert pdbs["etcd"]["spec"]["minAvailable"] == 2  # quorum of 3
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads()]
    for name, pdb in pdbs.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(all(labels.get(k) == v for k, v in selector.items()) for labels in pods), name
