"""A model call outlasts a supervised restart of the router: the harness client keeps
reconnecting for longer than the supervisor's longest back-off plus the time it waits for
a restarted service's ready line (30 s was shorter than one router restart on a loaded
machine: 28 episodes of the vLLM chaos demo failed)."""

from __future__ import annotations

from apps.procs import ServiceProcess
from apps.supervise import RestartPolicy
from gyre.client.harness import ROUTER_CONNECT_RETRY_S


def test_the_router_connect_budget_covers_a_supervised_restart():
    start = ServiceProcess("router", None).ready_timeout_s
    assert ROUTER_CONNECT_RETRY_S > RestartPolicy().backoff_max_s + start
