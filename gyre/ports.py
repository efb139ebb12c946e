"""Free loopback ports for processes that bind them later (the launcher's ``--free-ports``,
a private etcd, tests).

Binding port 0 and closing the socket hands out a port from the kernel's ephemeral range,
the same range every outgoing connection takes its source port from. Between choosing the
port and the service binding it (seconds, in a demo that starts a dozen processes, each
opening gRPC and etcd connections), a connection can take it and the service fails to bind:
CI's "router exited with 1 before ready". So :func:`free_port` draws ports at random from
below the ephemeral range, where connections never take a source port, keeps the ones that
bind now, and never hands out the same port twice in one process."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: well-known and registered services (etcd 2379, 8080, ...)
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux; 32768-60999
    elsewhere, the Linux default)."""
    try:
        low, high = _RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds on ``host`` now, outside the ephemeral range, not handed out before
    by this process."""
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    with _lock:
        if low - _LOWEST >= 1000:
            for _ in range(200):
                port = rng.randrange(_LOWEST, low)
                if port not in _given and _binds(host, port):
                    _given.add(port)
                    return port
        for _ in range(200):  # a machine whose ephemeral range starts low: the kernel's choice
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _given:
                _given.add(port)
                return port
    raise RuntimeError(f"no free port on {host}")


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
