"""Named failpoints: a fault injected at a chosen spot of a running service, chosen from
outside (fault tests, docs/reliability.md, "How it is tested").

A failpoint is a call ``failpoint("scheduler.transition.rerouted")`` at a transition. It does
nothing unless armed by name in

- ``$GYRE_FAILPOINTS``: ``name[=mode],...``, for one process (and what it starts);
- the file named by ``$GYRE_FAILPOINTS_FILE``, same syntax (lines or commas), re-read at
  every hit: a test arms and disarms failpoints in processes that are already running
  (and in their restarted successors).

Modes: none (exit at once with status 17, like a SIGKILL: nothing is flushed or closed),
``raise`` (raise :class:`FailpointCrash`, for in-process tests), ``enospc`` (raise
``OSError(ENOSPC)``: the disk is full). Unarmed, a failpoint costs two environment lookups
and a dict lookup (the variable's parse is cached by its value), or an ``open`` with the
file variable set. (It parsed the variable at every hit: 5 % of the packer's CPU under a
claim load, most of it in the WAL's write path.)
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import types
from collections.abc import Mapping

log = logging.getLogger(__name__)

FAILPOINT_ENV = "GYRE_FAILPOINTS"
FAILPOINT_FILE_ENV = "GYRE_FAILPOINTS_FILE"
EXIT_STATUS = 17


class FailpointCrash(BaseException):
    """Raised in-process by a failpoint in "raise" mode (unit tests)."""


def parse(spec: str) -> dict[str, str]:
    """``"a,b=raise"`` (commas or lines) -> ``{"a": "", "b": "raise"}``."""
    out: dict[str, str] = {}
    for item in spec.replace("\n", ",").split(","):
        name, _, mode = item.partition("=")
        if name.strip():
            out[name.strip()] = mode.strip()
    return out


@functools.lru_cache(maxsize=16)
def _parsed(spec: str) -> Mapping[str, str]:
    """:func:`parse` of an environment value, once per value (read-only)."""
    return types.MappingProxyType(parse(spec))


def _armed_now() -> Mapping[str, str]:
    armed = _parsed(os.environ.get(FAILPOINT_ENV, ""))
    path = os.environ.get(FAILPOINT_FILE_ENV, "")
    if path:
        try:
            with open(path) as f:
                return {**armed, **parse(f.read())}
        except FileNotFoundError:
            pass
    return armed


def failpoint(name: str) -> None:
    """Acts as armed for ``name`` (see the module docstring); returns when it is not."""
    mode = _armed_now().get(name)
    if mode is None:
        return
    if mode == "raise":
        raise FailpointCrash(name)
    if mode == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (failpoint {name})")
    log.error("failpoint %s: exiting", name)
    os._exit(EXIT_STATUS)
