"""The dashboard's typed configuration (section ``dashboard`` of the cluster YAML)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from gyre.config import ServiceConfig


class DashboardConfig(ServiceConfig):
    """Settings of the dashboard process; frozen after start-up.

    The dashboard binds ``host`` (loopback unless configured) on ``http_port``; it serves no
    gRPC, so the inherited ``port`` is unused. It reads the scheduler only (no etcd).
    """

    SECTION: ClassVar[str] = "dashboard"

    scheduler_target: str = Field(
        "127.0.0.1:50051",
        min_length=1,
        description="gRPC target of the scheduler (SchedulerControl.GetStatus); in Kubernetes "
        "a dns:/// name resolving to every replica: statuses from a lower epoch are ignored.",
    )
    http_port: int = Field(
        8080, ge=0, le=65535, description="Port of the dashboard's HTTP page and API (0 picks a free one)."
    )
    poll_interval_s: float = Field(0.5, gt=0, le=60, description="Period of GetStatus polls.")
    poll_timeout_s: float = Field(2.0, gt=0, le=60, description="Deadline of one GetStatus call.")
    watch_events: bool = Field(
        True, description="Follow SchedulerControl.WatchEvents (recent decisions panel)."
    )
    max_samples: int = Field(
        7200, ge=10, le=1_000_000, description="Samples kept in the timeline (older ones are dropped)."
    )
