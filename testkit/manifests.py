"""The Kubernetes manifests of ``deploy/k8s`` as the tests read them: strict YAML (a
duplicate key is an error), every document of every manifest, the workloads and their
containers; and, for manifests and the compose file alike, the Python module a container's
command runs and whether the tree has it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
PROMISED_MODULES = {
    "services.scheduler",
    "services.router",
    "services.packer",
    "services.cell_agent",
    "services.dashboard",
    "apps.harness.example",
    "apps.model.tiny",
}
"""The modules a deployment (compose file or manifests) runs at the least: every service,
the example harness and the tiny model."""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain YAML keeps the last silently)."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
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
    """Every Deployment, StatefulSet and Job (never none: a loop over them must check something)."""
    found = [d for _, d in all_docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert found, f"no workloads in {K8S}"
    return found


def containers(doc: dict[str, Any], init: bool = True) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", []) if init else []) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def final_command(command: list[str]) -> list[str]:
    """A container's command as it runs in the end: ``sh -c "a || b"`` is the words of its
    last alternative (the one that starts the service); any other command is itself."""
    if command[:2] == ["sh", "-c"]:
        return command[2].split("||")[-1].split()
    return command


def python_module(command: list[str]) -> str | None:
    """The module the :func:`final_command` of ``command`` runs with ``-m``; None without one."""
    cmd = final_command(command)
    return cmd[cmd.index("-m") + 1] if "-m" in cmd else None


def module_exists(module: str) -> bool:
    """Whether the tree has ``module``: for ``services.<svc>...`` the service's folder (its
    ``__main__.py`` may land later), else the module's file or a package with a ``__main__.py``."""
    parts = module.split(".")
    if parts[0] == "services":
        return (ROOT / "services" / parts[1]).is_dir()
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
