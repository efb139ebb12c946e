"""Free ports for processes that bind later come from below the ephemeral range: a port
from the ephemeral range can be taken as an outgoing connection's source port before its
service binds it (CI: "router exited with 1 before ready" in a demo test)."""

from __future__ import annotations

import socket

import apps.launch
import gyre.etcd.server
from gyre.ports import ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports), [p for p in ports if p >= low][:5]
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bound_port_is_not_handed_out():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(200))


def test_the_launcher_and_etcd_use_it():
    assert apps.launch.free_port is free_port and gyre.etcd.server.free_port is free_port
