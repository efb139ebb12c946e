"""``evolve``: ``dataclasses.replace`` for plain records on hot paths.

``dataclasses.replace`` re-runs the generated ``__init__`` with every field (≈6 µs for the
scheduler's 15-field ``ExecutionRecord``); the scheduler replaces a record or a route four
times per execution lifecycle. ``evolve`` copies the instance's ``__dict__`` and sets the
changed fields (≈1 µs). Only for dataclasses without ``__post_init__``, ``InitVar``s or
``__slots__`` (frozen or not), whose fields need no validation: it checks the first two and
the field names (a misspelt name raises TypeError, as ``replace`` does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_FIELDS: dict[type, frozenset[str]] = {}


def evolve(obj: T, **changes: Any) -> T:
    """A copy of dataclass instance ``obj`` with ``changes`` applied."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        if not dataclasses.is_dataclass(obj) or hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
            raise TypeError(f"evolve needs a plain dataclass, not {cls.__name__}")
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(obj))
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    new = object.__new__(cls)
    state = new.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return new
