"""Offline image builds are wired end to end: wheelhouse -> Dockerfile -> compose -> manifests.

Static checks (no container runs; `make compose-smoke` runs the real thing). Invariants:
`make wheelhouse` downloads every pin of requirements.lock (no dependency resolution) into a
git-ignored folder that the build context still carries; the Dockerfile installs from a
wheelhouse with ``--no-index`` when one is given and from the network otherwise, in a
build-only stage whose virtualenv alone reaches the runtime images; runtime images hold no
compiler and no package caches and run as uid/gid 10001, the user the Kubernetes manifests
ask for; the base image stays a build argument, which compose passes through, and the
Debian-built base image carries every package a Dockerfile step would otherwise fetch.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
BASE_SCRIPT = (ROOT / "scripts" / "base_image.sh").read_text()
RUNTIME_STAGES = ("base", "gyre", "gpu", "etcd")


def stages() -> dict[str, str]:
    """Each stage's body, by name."""
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.MULTILINE)[1:]
    out = {}
    for part in parts:
        head, _, body = part.partition("\n")
        name = head.split()[-1]
        out[name] = f"FROM {head}\n{body}"
    return out


def make_recipe(target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", MAKEFILE, flags=re.MULTILINE)
    assert match, f"no `make {target}`"
    return match.group(1)


def test_make_wheelhouse_downloads_every_pin_into_an_ignored_folder() -> None:
    recipe = make_recipe("wheelhouse")
    assert "pip download" in recipe and "--no-deps" in recipe and "-r requirements.lock" in recipe
    default = re.search(r"^WHEELHOUSE \?= (\S+)", MAKEFILE, flags=re.MULTILINE)
    assert default and default.group(1) == ".gyre/wheelhouse"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gyre/wheelhouse/x.whl"], cwd=ROOT, check=False)
    assert ignored.returncode == 0, "the wheelhouse must stay out of git"
    dockerignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert ".gyre" in dockerignore and "!.gyre/wheelhouse" in dockerignore
    assert dockerignore.index("!.gyre/wheelhouse") > dockerignore.index(".gyre"), "the exception comes last"


def test_dockerfile_installs_from_a_wheelhouse_offline_or_the_network() -> None:
    venv = stages()["venv"]
    default = re.search(r"^ARG WHEELHOUSE=(\S+)", venv, flags=re.MULTILINE)
    assert default, "WHEELHOUSE is a build argument"
    empty = ROOT / default.group(1)
    assert empty.is_dir() and not list(empty.glob("*.whl")), (
        "the default wheelhouse is empty: network install"
    )
    assert "COPY ${WHEELHOUSE} /wheelhouse/" in venv
    assert "--no-index --find-links /wheelhouse" in venv
    assert "--extra-index-url ${TORCH_INDEX_URL}" in venv
    assert re.search(r"pip install --no-deps \$src -r /tmp/runtime\.lock", venv)
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in DOCKERFILE
    assert all(stages()[s].startswith(("FROM ${PYTHON_IMAGE}", "FROM base")) for s in RUNTIME_STAGES)


def test_runtime_images_are_lean_and_run_as_10001() -> None:
    all_stages = stages()
    for name in RUNTIME_STAGES:
        body = all_stages[name]
        assert "/wheelhouse" not in body, f"{name} must not carry the wheelhouse"
        assert not re.search(r"^COPY \.\s", body, flags=re.MULTILINE), (
            f"{name} copies the whole context (wheelhouse)"
        )
        assert not re.search(r"build-essential|\bgcc\b|\bg\+\+", body), f"{name} installs a compiler"
        if "apt-get install" in body:
            assert "rm -rf /var/lib/apt/lists/*" in body, f"{name} keeps apt's lists"
    assert "COPY --from=venv /opt/gyre /opt/gyre" in all_stages["base"]
    assert "PIP_NO_CACHE_DIR=1" in all_stages["venv"]
    assert "import setuptools" in all_stages["venv"], "vLLM's tool-call parsers need setuptools at runtime"
    assert "--uid 10001 --gid 10001" in all_stages["base"] and "--uid 10001 --gid 10001" in all_stages["etcd"]
    for name in ("gyre", "gpu", "etcd"):
        users = re.findall(r"^USER\s+(\S+)", all_stages[name], flags=re.MULTILINE)
        assert users and users[-1] == "10001:10001", f"{name} runs as {users}"


def test_manifests_run_as_the_images_user() -> None:
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec") or {}
            pod = (spec.get("template") or {}).get("spec") or spec.get("jobTemplate", {}).get("spec", {})
            ctx = pod.get("securityContext") if isinstance(pod, dict) else None
            if ctx is None:
                continue
            assert (ctx.get("runAsUser"), ctx.get("runAsGroup"), ctx.get("fsGroup")) == (
                10001,
                10001,
                10001,
            ), path.name


def test_compose_passes_the_base_image_and_wheelhouse() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    built = {name: svc["build"] for name, svc in compose["services"].items() if "build" in svc}
    assert built, "compose builds the images"
    for name, build in built.items():
        args = build.get("args") or {}
        assert "GYRE_BASE_IMAGE" in str(args.get("PYTHON_IMAGE")), name
        assert "GYRE_WHEELHOUSE" in str(args.get("WHEELHOUSE")), name


def test_debian_base_image_carries_what_the_dockerfile_would_fetch() -> None:
    assert "debootstrap --variant=minbase" in BASE_SCRIPT
    packages = set(re.search(r"PACKAGES=\$\{PACKAGES:-([^}]+)\}", BASE_SCRIPT).group(1).split(","))
    assert {"python3", "python3-venv"} <= packages
    fetched = set()
    for line in re.findall(r"pkgs=\"([^\"]+)\"", DOCKERFILE) + re.findall(
        r"dpkg -s ([a-z0-9 -]+?) >", DOCKERFILE
    ):
        fetched |= {p for p in line.split() if not p.startswith("$")}
    assert fetched and fetched <= packages, f"an air-gapped build would need apt for {fetched - packages}"
    assert re.search(r"\bimport\b.*--change 'ENV PATH=", BASE_SCRIPT, flags=re.DOTALL)


def test_compose_health_checks_survive_podman() -> None:
    """podman's Docker API splits a health check's arguments on spaces: none may hold one."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        test = (svc.get("healthcheck") or {}).get("test") or []
        assert all(" " not in arg for arg in test[1:]), f"{name}: {test}"
