"""Every reference to a design document resolves inside the repository: a clone is complete
on its own. Scans the tracked text files (``git ls-files``) for the design-document names
the code used to cite from outside the tree (upper-case ``*.md`` names, a sibling design
folder) and for ``docs/design/*.md`` pages, and fails on any that names no tracked file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]

_DESIGN_NAMES = ("WORKLOADS", "ARCHITECTURE", "RELIABILITY", "TOOLING", "STYLE", "VLLM_CPU", "CALIBRATION")
# Written so this file does not match its own patterns.
_PATH = r"[\w./-]*"
_PATTERNS = (
    re.compile(_PATH + r"\b(?:" + "|".join(_DESIGN_NAMES) + r")\.md\b"),
    re.compile(_PATH + r"shared[/]design\b" + _PATH),
    re.compile(_PATH + r"docs[/]design[/][\w.-]+\.md\b"),
)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def _resolves(ref: str, source: str, tracked: set[str]) -> bool:
    """Whether ``ref`` (as written in ``source``) names a tracked file, taken relative to the
    source's folder or to the repository root; a path leaving the repository never does."""
    ref = ref.rstrip(".")
    for base in (PurePosixPath(source).parent, PurePosixPath("")):
        parts: list[str] = []
        ok = True
        for part in (base / ref).parts:
            if part == "..":
                if not parts:
                    ok = False
                    break
                parts.pop()
            elif part != ".":
                parts.append(part)
        if ok and "/".join(parts) in tracked:
            return True
    return False


def dangling_references(files: dict[str, str], tracked: set[str]) -> list[str]:
    """``path:line: reference`` for every design-document reference that resolves to no
    tracked file."""
    bad = []
    for path, text in sorted(files.items()):
        for lineno, line in enumerate(text.splitlines(), 1):
            refs = {m.group(0) for pattern in _PATTERNS for m in pattern.finditer(line)}
            bad.extend(f"{path}:{lineno}: {ref}" for ref in sorted(refs) if not _resolves(ref, path, tracked))
    return bad


def _text_files(paths: list[str]) -> dict[str, str]:
    files = {}
    for rel in paths:
        p = ROOT / rel
        if not p.is_file():
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files[rel] = data.decode("utf-8", errors="replace")
    return files


def test_the_checker_flags_what_does_not_resolve() -> None:
    # The names are assembled so that this file holds no reference of its own.
    md = ".md"
    outside = "../shared" + "/design/RELIABILITY" + md
    missing = "docs/design/missing" + md
    tracked = {"docs/design/workloads.md", "docs/reliability.md", "sim/config.py"}
    files = {
        "sim/config.py": 'x = 1  # docs/design/workloads.md, "Drift"\n# see WORKLOADS' + md + "\n",
        "docs/reliability.md": f"`{outside}` and ../design/workloads.md\n",
        "docs/a.md": f"[w](design/workloads.md) [x](design/tooling.md) {missing}\n",
    }
    assert dangling_references(files, tracked) == [
        f"docs/a.md:1: {missing}",
        f"docs/reliability.md:1: {outside}",
        "sim/config.py:2: WORKLOADS" + md,
    ]


def test_every_design_reference_resolves_inside_the_repository() -> None:
    paths = _tracked()
    bad = dangling_references(_text_files(paths), set(paths))
    assert not bad, "references to design documents outside the repository:\n" + "\n".join(bad)
