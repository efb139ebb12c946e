"""The short mock-engine demo the fault and end-to-end tests run: 2 bursts of 10 groups of 4,
long uneven episodes (stragglers still running when a cell moves), fast mock engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from apps.demo.runner import DemoOptions
from apps.harness.env import EnvConfig
from apps.launch import Cluster


def short_demo(
    run_dir: Path,
    scheduler: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
    **options: Any,
) -> DemoOptions:
    """DemoOptions of the short demo in ``run_dir``; ``scheduler`` adds scheduler settings
    (``interval_s`` 0.5 is always set), ``router`` router settings, ``options`` replace or
    add DemoOptions fields (``during``, ``chaos``, ``dashboard_port``, ``timeout_s``)."""
    defaults: dict[str, Any] = dict(
        engine="mock",
        bursts=2,
        run_dir=run_dir,
        dashboard_port=0,
        concurrency=24,
        timeout_s=400,
        live=False,
        warm_start=False,  # mock engines: the model's skill does not matter, its start-up does
        eval_tasks=0,
        env=EnvConfig(turns_median=3, turns_sigma=0.8, turns_max=10, time_scale=0.2, max_tokens=8),
        config_overrides={
            "cell_agent": {"mock": {"time_scale": 0.05}, "slots": 6},
            "scheduler": {"interval_s": 0.5, **(scheduler or {})},
            **({"router": router} if router else {}),
        },
    )
    return DemoOptions(**(defaults | options))


def restarted(cluster: Cluster, name: str, old_pid: int) -> bool:
    """``name`` runs again as a new process, restarted by the supervisor (its ready line
    seen): a fault test injects its next fault only then."""
    (state,) = [s for s in cluster.supervisor.status() if s["name"] == name]
    return state["state"] == "running" and state["pid"] not in (None, old_pid)
