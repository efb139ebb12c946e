"""Test modules live in folders without ``__init__.py`` (pytest's rootdir import mode), so
two test files with one basename break collection of the whole suite ("import file
mismatch"), though each passes alone. A claim-stream unit test and its integration twin
did just that (caught at merge, before CI)."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_its_own_basename():
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
