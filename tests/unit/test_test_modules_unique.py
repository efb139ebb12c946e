"""Every test module has its own basename across tests/: the test folders are not packages,
so pytest imports each module by its basename, and two of one name stop the whole
collection ("import file mismatch"): make test once collected nothing because
tests/unit/test_router_rebuild.py and tests/integration/test_router_rebuild.py met."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert len(names) > 50  # the walk found the suite
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, clashes
