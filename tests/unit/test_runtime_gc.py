"""A service freezes its start-up heap once it has started (``gc_freeze``, on by default):
what was alive then leaves the collector's generations, what is allocated later is still
collected."""

from __future__ import annotations

import subprocess
import sys

from gyre.config import ServiceConfig

_PROBE = """
import gc, json, weakref
from gyre.runtime import freeze_startup_heap

class Node:
    pass

startup = [Node() for _ in range(1000)]
freeze_startup_heap()
frozen = gc.get_freeze_count()
later = Node()
later.self = later  # a cycle allocated after the freeze: still collected
ref = weakref.ref(later)
del later
gc.collect()
print(json.dumps({"frozen": frozen, "later_collected": ref() is None}))
"""


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] >= 1000  # the start-up objects, and everything imported
    assert got["later_collected"]


def test_freezing_is_on_by_default_and_can_be_switched_off():
    assert ServiceConfig().gc_freeze is True
    assert ServiceConfig(gc_freeze=False).gc_freeze is False
