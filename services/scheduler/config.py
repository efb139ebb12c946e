"""The scheduler's typed configuration (section ``scheduler:`` of the cluster YAML)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from gyre.config import ServiceConfig
from gyre.staleness import StalenessSettings
from services.scheduler.policy import GyreConfig, PolicyName


class GyreSettings(BaseModel):
    """The Gyre policy's settings (:class:`~services.scheduler.policy.GyreConfig`, whose
    defaults they take), flat as ``gyre_*``: one definition for the scheduler's config
    and the simulator's."""

    gyre_min_horizon_s: float = Field(
        GyreConfig.min_horizon_s,
        gt=0,
        description="Gyre: horizon over which the training prefix drains the trainer's queue.",
    )
    gyre_hysteresis: float = Field(
        GyreConfig.hysteresis, ge=0, description="Gyre: cells kept beyond the target, fraction of it."
    )
    gyre_saturated_share: float = Field(
        GyreConfig.saturated_share,
        gt=0,
        le=1,
        description="Gyre: share of the rate target the training prefix is sized to while rollout "
        "is saturated (W_eta exceeds the slots the target leaves to rollout); 1: off.",
    )
    gyre_plan_ahead: int = Field(
        GyreConfig.plan_ahead, ge=0, description="Gyre: cells planned beyond the next moves."
    )
    gyre_rates: bool = Field(GyreConfig.rates, description="Gyre lever: size the training prefix from rates.")
    gyre_keep: bool = Field(
        GyreConfig.keep, description="Gyre lever: hysteresis (keep satellites across updates)."
    )
    gyre_plan: bool = Field(
        GyreConfig.plan,
        description="Gyre lever: PlanMoves (placement avoids planned cells, spreads the rest).",
    )
    gyre_migrate: bool = Field(
        GyreConfig.migrate, description="Gyre lever: migrate tail executions off crowded engines."
    )
    gyre_breathe: bool = Field(
        GyreConfig.breathe,
        description="Gyre lever: breathing (spare cells train while there is training work; the core "
        "rolls out while there is none and committed work waits for slots).",
    )
    gyre_breathe_in: float = Field(
        GyreConfig.breathe_in,
        gt=0,
        le=1,
        description="Gyre: ready groups, as a fraction of the batch, that bring a breathing core back.",
    )
    gyre_lend_min_s: float = Field(
        GyreConfig.lend_min_s,
        ge=0,
        description="Gyre: training seconds a cell lent to the streaming batch must find (about a "
        "switch each way).",
    )
    gyre_kv: bool = Field(
        GyreConfig.kv,
        description="Gyre lever: rollout capacity in executions the KV cache keeps resident at the "
        "measured mean context, where that is fewer than the slots.",
    )
    gyre_kv_cut_share: float = Field(
        GyreConfig.kv_cut_share,
        gt=0,
        le=1,
        description="Gyre: share of rollout time spent recomputing evicted prefixes from which "
        "dispatch is cut to what the rollout KV keeps (1: off).",
    )
    gyre_kv_fill: float = Field(
        GyreConfig.kv_fill,
        gt=0,
        le=1,
        description="Gyre: share of a cell's KV cache its rollout capacity counts on (the rest is "
        "headroom for growing contexts and cells holding longer agents than the mean); 1: all of it.",
    )
    gyre_kv_headroom_after: float = Field(
        GyreConfig.kv_headroom_after,
        ge=0,
        le=1,
        description="Gyre: the KV headroom (gyre_kv_fill) applies once recomputing evicted prefixes has "
        "taken this share of rollout's time in the run (before: the whole KV; where recompute is not "
        "measured, from the start; 0: always).",
    )
    gyre_parallel_moves: float = Field(
        GyreConfig.parallel_moves,
        ge=0,
        le=1,
        description="Gyre: moves to training in flight at once, as a fraction of the elastic cells "
        "(at least one; 0: one at a time).",
    )
    gyre_breathe_out: float = Field(
        GyreConfig.breathe_out,
        ge=0,
        le=1,
        description="Gyre: executions waiting for slots, as a fraction of the core's slots, that send "
        "a breathing core to rollout.",
    )
    gyre_wave_waits: bool = Field(
        GyreConfig.wave_waits,
        description="Gyre lever: a dispatch of at least half a batch waits while elastic cells are on "
        "their way back to rollout, so that it spreads over them too.",
    )
    gyre_migrate_max: int = Field(GyreConfig.migrate_max, ge=0, description="Gyre: migrations per decision.")
    gyre_migrate_min_load: float = Field(
        GyreConfig.migrate_min_load,
        ge=0,
        le=1,
        description="Gyre: engines above this fraction of their slots give tail executions away.",
    )

    def gyre_settings(self) -> dict[str, Any]:
        """The ``gyre_*`` fields by name (to hand on to a scheduler's config)."""
        return {name: getattr(self, name) for name in GyreSettings.model_fields}

    def gyre_config(self, drain_grace_s: float) -> GyreConfig:
        """The policy's parameters."""
        return GyreConfig(
            **{name.removeprefix("gyre_"): value for name, value in self.gyre_settings().items()},
            drain_grace_s=drain_grace_s,
        )


class StaleRuleSettings(StalenessSettings):
    """eta, the rule for groups no batch within it can take (:mod:`gyre.staleness`) and the
    partial rule's limit: one definition for the scheduler's config and the simulator's."""

    partial_max_versions: int | None = Field(
        None,
        ge=0,
        description="Under the partial rule: a group goes on only while its new stamp is at most this many "
        "versions past its dispatch, so a consumed group was dispatched at most max_staleness + this "
        "versions before its batch; past it, it is cancelled (null: no limit). A first restamp already "
        "moves a group max(max_staleness, 1) versions (to the trainer's version), so a smaller limit is "
        "the cancel rule.",
    )


class SchedulerConfig(ServiceConfig, GyreSettings, StaleRuleSettings):
    """Bursts, the role policy (``gyre`` unless configured), heartbeats, peers and observability."""

    SECTION: ClassVar[str] = "scheduler"

    # Bursts and batches.
    batch_size: int = Field(4, ge=1, le=100_000, description="Groups per training batch.")
    group_size: int = Field(2, ge=1, le=1024, description="Executions per group (one task).")
    over_provision: float = Field(
        0.25,
        ge=0.0,
        le=10.0,
        description="Extra groups per burst, as a fraction of batch_size, so stragglers need not be waited for.",
    )
    batches_per_burst: int = Field(
        1, ge=1, le=1000, description="Optimizer updates per burst; the last publishes."
    )
    max_bursts: int = Field(
        0, ge=0, description="Stop dispatching after this many bursts (0: until tasks run out)."
    )

    archive_grace_s: float = Field(
        30.0,
        ge=0.0,
        le=86_400.0,
        description="A burst older than the newest, fully closed and reported to the packer, is archived "
        "(folded into the ledger summary, its records deleted from etcd) once its last close is this old; "
        "until then a harness's late finish retry is still answered as a duplicate, after it with NOT_FOUND "
        "saying the burst was archived (the shipped harness client answers that as the duplicate).",
    )

    # Task source.
    tasks_file: str = Field(
        "", description="JSONL of tasks ({'id': ..., ...} per line); empty: built-in generator."
    )
    task_seed: int = Field(0, description="Seed of the built-in task generator.")
    loop_tasks: bool = Field(True, description="Start the tasks file over when it runs out.")

    # The role policy.
    policy: PolicyName = Field(
        "gyre",
        description="Role policy (services/scheduler/policy): gyre, the default (overlapping bursts under the "
        "staleness bound, cells sized from rates), waterlevel / waterlevel-sync (the seed's burst-synchronous "
        "policy), the baselines colocated, static, async-static, async-static-lend; rollout_only never trains "
        "(bursts back to back).",
    )
    rate_window_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="Window over which the asynchronous policies' rates (ready groups, training) are measured.",
    )
    fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="Ready groups needed, as a fraction of batch_size."
    )
    interval_s: float = Field(5.0, ge=0.0, le=3600.0, description="How long supply must hold before a move.")
    drain_grace_s: float = Field(
        2.0,
        ge=0.0,
        le=600.0,
        description="W = 0 for this long: the burst is drained (seal a partial batch, or skip a burst "
        "with nothing trainable).",
    )
    static_training_cells: int = Field(1, ge=0, description="Training cells of the static-split baseline.")
    reconcile_s: float = Field(0.5, gt=0.0, le=60.0, description="Period of the control loop.")

    # Executions.
    heartbeat_interval_s: float = Field(5.0, gt=0.0, description="How often harnesses should heartbeat.")
    heartbeat_deadline_s: float = Field(30.0, gt=0.0, description="No heartbeat for this long: TIMED_OUT.")
    reward_min: float = Field(
        0.0,
        ge=-1e9,
        le=1e9,
        allow_inf_nan=False,
        description="Smallest reward accepted for COMPLETED (below: INVALID_ARGUMENT); finite, "
        "within the packer's max_abs_reward.",
    )
    reward_max: float = Field(
        1e6,
        ge=-1e9,
        le=1e9,
        allow_inf_nan=False,
        description="Largest reward accepted for COMPLETED (above: INVALID_ARGUMENT); finite, "
        "within the packer's max_abs_reward.",
    )
    max_wait_s: float = Field(60.0, ge=0.0, description="Cap on AcquireExecution's wait_s.")
    execution_token_ttl_s: float = Field(
        86_400.0,
        gt=0.0,
        description="An execution token expires this long after launch (the router and the scheduler "
        "refuse it; the execution then times out). Closing an execution revokes its token at once.",
    )

    # Harness credentials and limits (gyre.apikeys, services/scheduler/harness_gate.py).
    harness_keys_file: str = Field(
        "",
        description="Hashed harness API keys ('NAME SHA256HEX' lines; python -m gyre.apikeys add). "
        "Empty: harnesses authenticate with their certificate only.",
    )
    harness_require_key: bool = Field(False, description="Refuse harnesses that present no API key.")
    harness_max_inflight: int = Field(
        1024, ge=0, description="Executions one harness may hold at once (0: no limit)."
    )
    harness_acquire_rate_per_s: float = Field(
        200.0, ge=0.0, description="AcquireExecution calls per second per harness (0: no limit)."
    )
    harness_acquire_burst: int = Field(400, ge=1, description="Burst of the per-harness acquire rate.")
    model: str = Field("gyre-policy", description="Model name harnesses send in OpenAI requests.")

    # Peers.
    router_http_url: str = Field(
        "http://127.0.0.1:8000/v1", description="Router's OpenAI base URL given to harnesses."
    )
    router_target: str = Field("", description="Router gRPC target (also used when no router is registered).")
    packer_target: str = Field("", description="Packer gRPC target; empty: no finish reports, no supply.")
    orphan_grace_s: float = Field(
        3.0,
        ge=0.0,
        description="Reroute the executions of a cell whose registration has been gone this long.",
    )
    engine_probe_timeout_s: float = Field(
        1.0,
        gt=0.0,
        description="A cell reported failed by a router is dead when it does not answer a probe "
        "within this long; its executions are then rerouted at once.",
    )
    drain_timeout_s: float = Field(30.0, gt=0.0, description="Longest wait for a draining cell to empty.")
    command_timeout_s: float = Field(
        30.0, gt=0.0, description="Deadline of CellControl commands (LoadPolicy pulls weights)."
    )

    # Observability.
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0: off).")
    events_kept: int = Field(10_000, ge=10, description="Events kept for WatchEvents.")

    def groups_per_burst(self) -> int:
        """Groups a burst dispatches: batch_size * batches_per_burst, plus over-provision
        rounded up (as the simulator does: 25% of 2 groups is one extra group, where
        Python's round() would give none)."""
        base = self.batch_size * self.batches_per_burst
        return base + math.ceil(self.over_provision * self.batch_size - 1e-9)
