"""Run metrics in the field's vocabulary: time to N updates, GPU-seconds by category, idle
ratios, role switches, reroutes, staleness and episode latency, plus the conservation
checks (executions and GPU-seconds) that the tests assert."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.cluster import CATEGORIES, ExecState

if TYPE_CHECKING:
    from sim.driver import Driver


@dataclass
class RunResult:
    """Everything one run produced (JSON-serializable through ``to_json``)."""

    policy: str
    label: str
    scenario: str
    cells: int
    updates: int
    reached: bool
    time_to_n_s: float
    update_times_s: list[float]
    gpu_s: dict[str, float]
    gpu_s_total: float
    cell_seconds: float
    trainer_idle_ratio: float
    rollout_idle_ratio: float
    role_switches: int
    role_switch_s: float
    role_switch_gpu_s: float
    reroutes: int
    reroute_recompute_tokens: int
    reroute_gpu_s: float  # prefix recompute (or KV handoff) that reroutes cost
    kv_handoffs: int
    preemptions: int  # running sequences preempted when their engine's KV filled (recompute)
    kv_evictions: int  # cached prefixes evicted while their execution waited on a tool
    kv_recompute_tokens: int  # prefix tokens prefilled again after a preemption or an eviction
    kv_recompute_gpu_s: float  # the GPU-s of those prefills (part of gpu_s["prefill"])
    staleness_mean: float
    staleness_max: int
    stale_token_fraction: float
    beyond_eta_token_fraction: float  # consumed tokens generated more than eta versions back
    restamped_groups: int  # groups the partial rule moved to a newer stamp
    dropped_groups: int  # cancelled early (staleness rule) + dropped stale at assignment
    cancelled_executions: int
    dispatched_groups: int
    dropped_share: float  # dropped groups / dispatched groups
    length_bias: float  # mean generated tokens of consumed groups / of dispatched groups
    migrations: int
    sealed_batches: int
    consumed_groups: int
    partial_batch_groups: int  # groups already assigned to the batch in progress at the end
    consumed_tokens: int
    train_tokens_per_cell_s: float
    episode_latency_s: dict[str, float]
    ledger: dict[str, int]
    exec_states: dict[str, int]
    decisions: int
    holds: int
    events_processed: int
    sim_wall_s: float  # the simulator's own wall time for this run
    decide_ms_p50: float  # wall time of one policy.decide() call, median
    decide_ms_p99: float
    timeseries: list[dict[str, float]] = field(default_factory=list)
    actions: list[tuple[float, str, str]] = field(default_factory=list)

    def to_json(self, with_series: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_series:
            d.pop("timeseries")
            d.pop("actions")
        return d


def collect(drv: Driver, end_s: float, wall_s: float) -> RunResult:
    cl = drv.cluster
    gpu = {c: 0.0 for c in CATEGORIES}
    for cell in cl.cells:
        for k, v in cell.acc.items():
            gpu[k] += v
    total = sum(gpu.values())
    rollout_time = gpu["decode"] + gpu["prefill"] + gpu["idle_rollout"]
    train_time = gpu["train"] + gpu["idle_train"]
    tr = cl.trainer
    lag_tokens = tr.lag_tokens
    n_tok = sum(lag_tokens.values())
    mean_lag = sum(k * v for k, v in lag_tokens.items()) / n_tok if n_tok else 0.0
    stale = sum(v for k, v in lag_tokens.items() if k > 0) / n_tok if n_tok else 0.0
    beyond = sum(v for k, v in lag_tokens.items() if k > tr.max_staleness) / n_tok if n_tok else 0.0
    lat = [
        ex.closed_s - ex.launched_s
        for ex in cl.executions
        if ex.state is ExecState.CLOSED and not ex.cancelled
    ]
    pct = {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)} if lat else {}
    pct["max"] = float(max(lat)) if lat else 0.0
    states: dict[str, int] = {}
    for ex in cl.executions:
        states[ex.state.name] = states.get(ex.state.name, 0) + 1
    led = cl.ledger
    reached = drv.done_s is not None
    return RunResult(
        policy=drv.spec.name,
        label=drv.spec.label,
        scenario=drv.scenario.name,
        cells=len(cl.cells),
        updates=len(drv.update_times),
        reached=reached,
        time_to_n_s=end_s if reached else float("inf"),
        update_times_s=list(drv.update_times),
        gpu_s=gpu,
        gpu_s_total=total,
        cell_seconds=end_s * len(cl.cells),
        trainer_idle_ratio=gpu["idle_train"] / train_time if train_time > 0 else 0.0,
        rollout_idle_ratio=gpu["idle_rollout"] / rollout_time if rollout_time > 0 else 0.0,
        role_switches=cl.role_switches,
        role_switch_s=cl.switch_s,
        role_switch_gpu_s=gpu["role_switch"],
        reroutes=cl.reroutes,
        reroute_recompute_tokens=cl.reroute_recompute_tokens,
        reroute_gpu_s=cl.reroute_gpu_s,
        kv_handoffs=cl.kv_handoffs,
        preemptions=cl.preemptions,
        kv_evictions=cl.kv_evictions,
        kv_recompute_tokens=cl.kv_recompute_tokens,
        kv_recompute_gpu_s=cl.kv_recompute_gpu_s,
        staleness_mean=mean_lag,
        staleness_max=max(lag_tokens) if lag_tokens else 0,
        stale_token_fraction=stale,
        beyond_eta_token_fraction=beyond,
        restamped_groups=cl.restamped_groups,
        dropped_groups=tr.dropped_groups + cl.cancelled_groups,
        cancelled_executions=cl.cancelled_executions,
        dispatched_groups=len(cl.groups),
        dropped_share=(tr.dropped_groups + cl.cancelled_groups) / len(cl.groups) if cl.groups else 0.0,
        length_bias=_length_bias(cl.groups),
        migrations=cl.migrations,
        sealed_batches=cl.sealed_batches,
        consumed_groups=tr.consumed_groups,
        partial_batch_groups=tr.batch_groups - tr.needs,
        consumed_tokens=tr.consumed_tokens,
        train_tokens_per_cell_s=tr.consumed_tokens / (end_s * len(cl.cells)) if end_s > 0 else 0.0,
        episode_latency_s=pct,
        ledger={
            "dispatched": led.dispatched,
            "launched": led.launched,
            "finished": led.finished,
            "queued": led.dispatched - led.launched,
            "running": led.launched - led.finished,
            "waterlevel": led.dispatched - led.finished,
        },
        exec_states=states,
        decisions=drv.decisions,
        holds=drv.holds,
        events_processed=drv.loop.processed,
        sim_wall_s=wall_s,
        decide_ms_p50=float(np.percentile(drv.decide_s, 50)) * 1e3 if drv.decide_s else 0.0,
        decide_ms_p99=float(np.percentile(drv.decide_s, 99)) * 1e3 if drv.decide_s else 0.0,
        timeseries=[vars(s) for s in drv.samples],
        actions=list(drv.events),
    )


def _length_bias(groups) -> float:
    """Mean generated tokens of the consumed groups over that of all dispatched groups (< 1:
    over-provision and cancelling favour short episodes)."""
    if not groups:
        return 1.0
    used = [g.length for g in groups if g.consumed]
    every = sum(g.length for g in groups) / len(groups)
    return (sum(used) / len(used)) / every if used and every > 0 else 1.0
