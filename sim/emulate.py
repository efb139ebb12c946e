"""The emulated cluster (item 2 of the cluster benchmark): the same scenario on the real
services (a private etcd, the scheduler, router and packer, elastic cell agents with mock
engines whose timing model is ``sim.cost``, and the cost-model trainer
``services/cell_agent/training/mock_trainer.py``), time-scaled, to check that the simulator
tells the truth.

``run_emulated`` renders one cluster YAML from the scenario (cost parameters on the mock
engines and the trainer, the scheduler's batch/group/fraction/interval with every duration
divided by the time scale), starts it with ``apps.launch.Cluster``, plays the scenario's
trace through ``sim.emulate_driver.ReplayDriver``, records when each policy version
appears at ``keys.policy()``, and runs the simulator (the waterlevel policy) on the
identical scenario at the same cell count. The wall time to N updates times the time scale
is the emulated time; the relative difference to the simulated time is reported against a
stated tolerance (never asserted: that is the benchmark's job).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sim.config import ScenarioConfig, SimConfig, apply_variant

REQUIRED_MODULES = (
    "services.scheduler.__main__",
    "services.router.__main__",
    "services.packer.__main__",
    "services.cell_agent.__main__",
)
ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / ".gyre" / "models" / "tiny-seed0"


@dataclass(frozen=True)
class EmulationResult:
    """Agreement between the emulated cluster and the simulator on one scenario."""

    ran: bool
    reason: str
    emulated_time_to_n_s: float = float("nan")
    simulated_time_to_n_s: float = float("nan")
    relative_difference: float = float("nan")
    tolerance: float = 0.2
    cells: int = 0
    updates: int = 0
    time_scale: float = 0.0
    wall_s: float = 0.0
    emulated_update_times_s: list[float] = field(default_factory=list)
    simulated_update_times_s: list[float] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)
    scenario: dict[str, Any] = field(default_factory=dict)
    policy: str = "waterlevel"
    """The policy both ran (the live scheduler's and the simulator's)."""
    simulated_reroutes: int = 0
    simulated_stale_groups: tuple[int, int] = (0, 0)
    """Groups the simulator's rule for unconsumable groups cancelled and restamped."""

    @property
    def within_tolerance(self) -> bool:
        return math.isfinite(self.relative_difference) and abs(self.relative_difference) <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["within_tolerance"] = self.within_tolerance
        return out


def missing_services() -> list[str]:
    """Service entry points that do not exist in this checkout."""
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def small_scenario(
    cfg: SimConfig,
    scenario: ScenarioConfig,
    *,
    cells: int,
    slots: int,
    batch_groups: int,
    updates: int,
    turns_median: float = 4,
    turns_hi: int = 10,
    initial_prompt_tokens: int = 1000,
    sandbox_median_s: float = 5.0,
    reward_median_s: float = 10.0,
) -> tuple[SimConfig, ScenarioConfig]:
    """``scenario`` scaled down to run on this machine: fewer cells, slots, groups and
    turns, shorter prompts (the same scaled scenario then runs in both the emulator and the
    simulator). Everything else (token and tool distributions, cost model) is kept."""
    p = scenario.profile
    overrides = [
        f"scenario.cluster.cells={cells}",
        "scenario.cluster.standalone_cells=0",
        f"scenario.cluster.slots_per_cell={slots}",
        f"scenario.training.batch_groups={batch_groups}",
        f"scenario.training.updates={updates}",
        "scenario.training.horizon_s=100000",
        f"profiles.{p}.turns.median={turns_median}",
        f"profiles.{p}.turns.hi={turns_hi}",
        f"profiles.{p}.initial_prompt_tokens={initial_prompt_tokens}",
    ]
    prof = cfg.profiles[p]
    if prof.sandbox_start_s is not None:
        overrides.append(f"profiles.{p}.sandbox_start_s.median={sandbox_median_s}")
    if prof.reward_s is not None:
        overrides.append(f"profiles.{p}.reward_s.median={reward_median_s}")
    return apply_variant(cfg, scenario, overrides)


def max_context(cfg: SimConfig, sc: ScenarioConfig) -> int:
    """An upper bound of an episode's final context in this scenario (for size limits)."""
    p = cfg.profiles[sc.profile]
    turns = int(p.turns.hi or 250)
    out_hi = min(p.output_tokens.hi or 16384, p.max_total_output_tokens)
    obs_hi = p.observation_tokens.hi or 8000
    return int(p.initial_prompt_tokens + min(turns * out_hi, p.max_total_output_tokens) + turns * obs_hi)


def render_config(
    cfg: SimConfig,
    sc: ScenarioConfig,
    *,
    time_scale: float,
    model_dir: str,
    tick_s: float = 0.05,
    policy: str = "waterlevel",
) -> dict[str, Any]:
    """The cluster YAML (as a dict) of the emulated scenario; ports are placeholders that
    ``Cluster(free_ports=True)`` remaps."""
    c, pp, tr = cfg.cost, cfg.policy, sc.training
    prof = cfg.profiles[sc.profile]
    ts = time_scale
    scale = 1.0 / ts
    budget = min(max(8192, 2 * max_context(cfg, sc)), 16_777_216)
    slots = sc.cluster.slots_per_cell
    cells = sc.cluster.cells
    return {
        "cluster": {
            "name": "emulate",
            "etcd_endpoints": ["127.0.0.1:23890"],
            "lease_ttl_s": 10,
            "max_staleness": tr.max_staleness,
            "stale_rule": tr.stale_rule,
        },
        "scheduler": {
            "port": 50151,
            "router_target": "127.0.0.1:50152",
            "router_http_url": "http://127.0.0.1:8100/v1",
            "packer_target": "127.0.0.1:50153",
            "batch_size": tr.batch_groups,
            "group_size": prof.group_size,
            "over_provision": tr.overprovision,
            "batches_per_burst": 1,
            "max_bursts": 0,
            "policy": policy,
            **pp.gyre_settings(),
            "gyre_min_horizon_s": pp.gyre_min_horizon_s * scale,
            "rate_window_s": pp.rate_window_s * scale,
            "fraction": pp.supply_fraction,
            "interval_s": pp.supply_interval_s * scale,
            "drain_grace_s": pp.drain_grace_s * scale,
            "reconcile_s": tick_s,
            "heartbeat_interval_s": 5.0,
            "heartbeat_deadline_s": 600.0,
            "max_wait_s": 10.0,
            "model": "emulate",
            "orphan_grace_s": 3.0,
            # One driver stands for every harness of the emulated cluster: no per-harness caps.
            "harness_max_inflight": 0,
            "harness_acquire_rate_per_s": 0.0,
        },
        "router": {
            "port": 50152,
            "http_port": 8100,
            "packer_target": "127.0.0.1:50153",
            "served_model_name": "emulate",
            "model_dir": model_dir,
            "max_prompt_tokens": max(131072, budget),
            "max_tokens_limit": 32768,
            # The tiny model only tokenizes here; the mock engines serve contexts of any length.
            "max_model_len": max(131072, budget),
        },
        "packer": {
            "port": 50153,
            "wal_dir": "{run_dir}/packer-wal",
            "wal_fsync": False,
            "batch_size": tr.batch_groups,
            "micro_step_token_budget": budget,
            "ready_grace_s": min(0.25, 0.1 + tick_s),
        },
        "cell_agent": {
            "engine": "mock",
            "slots": slots,
            "mock": {
                "time_scale": scale,
                "step_overhead_s": c.decode_step_overhead_s,
                "n_params": c.n_params,
                "weight_bytes": c.weight_bytes,
                "n_layers": c.n_layers,
                "d_model": c.d_model,
                "kv_bytes_per_token": c.kv_bytes_per_token,
                # The mock's efficiencies are fixed (0.8 of HBM, 0.5 of FLOPs): fold the scenario's in.
                "hbm_bytes_per_s": c.hbm_bw * c.gpus_per_cell * c.hbm_eff / 0.8,
                "flops": c.flops * c.gpus_per_cell * c.decode_flops_eff / 0.5,
                "weight_load_s": c.weight_sync_s,
                "sleep_s": c.switch_to_train_s,
                "wake_s": c.switch_to_rollout_s,
                "max_batch": max(slots, 1),
            },
            "max_prompt_tokens": max(131072, budget),
            "drain_wait_s": 10.0,
            "training": {
                "mode": "mock",
                "packer_target": "127.0.0.1:50153",
                "time_scale": scale,
                "n_params": c.n_params,
                "flops": c.flops,
                "train_flops_eff": c.train_flops_eff,
                "gpus_per_cell": c.gpus_per_cell,
                "train_step_fixed_s": c.train_step_fixed_s,
                "weight_sync_s": c.weight_sync_s,
                "claim_wait_s": 0.5,
                "done_poll_s": 0.02,
            },
        },
        "launch": {
            "etcd": {},
            "processes": [
                {"service": "packer"},
                {"service": "scheduler"},
                {"service": "router"},
                *[
                    {
                        "service": "cell_agent",
                        "name": f"cell-{i}",
                        "set": {"cell_id": f"cell-{i}", "kind": "elastic", "index": i, "port": 50200 + i},
                    }
                    for i in range(cells)
                ],
            ],
        },
    }


def ensure_model(model_dir: Path = TINY_MODEL) -> Path:
    """The tiny model (the router's tokenizer), built once and cached like the demo's."""
    if (model_dir / "tokenizer.json").exists() or (model_dir / "config.json").exists():
        return model_dir
    from apps.model.tiny import build_tiny_model

    return Path(build_tiny_model(model_dir, seed=0))


def simulate(cfg: SimConfig, sc: ScenarioConfig, policy: str = "waterlevel") -> Any:
    """The simulator's run of ``policy`` on the same scenario (sim.driver.RunResult)."""
    from sim.driver import PolicySpec, run_policy

    return run_policy(cfg, sc, PolicySpec(policy))


async def _emulate(
    cluster: Any,
    cfg: SimConfig,
    sc: ScenarioConfig,
    time_scale: float,
    ready_timeout_s: float,
    run_timeout_s: float,
) -> tuple[list[float], dict[str, Any]]:
    from gyre.etcd import Etcd, Keys
    from sim.emulate_driver import ReplayDriver, watch_updates
    from sim.workload import Trace

    conf = cluster.config
    keys = Keys(conf["cluster"]["name"])
    etcd = Etcd(conf["cluster"]["etcd_endpoints"], timeout_s=5.0, tls=cluster.pki.tls("operator"))
    await etcd.connect()
    try:
        cells = sc.cluster.cells
        deadline = time.monotonic() + ready_timeout_s
        while True:  # every cell registered and serving
            _, states = await etcd.get_prefix(keys.cell_states())
            serving = sum(1 for kv in states if json.loads(kv.value).get("state") == "ROLLOUT")
            if serving >= cells or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

        async def version() -> int:
            kv = await etcd.get(keys.policy())
            return 0 if kv is None else int(json.loads(kv.value).get("version", 0))

        trace = Trace(cfg.profiles[sc.profile], sc.seed, sc.drift)
        driver = ReplayDriver(
            trace=trace,
            scheduler_target=conf["scheduler"]["_target"],
            router_target=conf["router"]["_target"],
            time_scale=time_scale,
            workers=cells * sc.cluster.slots_per_cell + 8,
            tls_dir=None if cluster.pki.insecure else str(cluster.pki.identity_dir("harness")),
            insecure=cluster.pki.insecure,
        )
        stop = asyncio.Event()
        t0 = time.monotonic()
        replay = asyncio.create_task(driver.run(stop))
        watcher = asyncio.create_task(watch_updates(version, sc.training.updates, stop, t0))
        try:
            times = await asyncio.wait_for(asyncio.shield(watcher), run_timeout_s)
        except TimeoutError:
            stop.set()
            times = []
        watcher.cancel()
        stats = await replay
        return times, asdict(stats)
    finally:
        await etcd.close()


async def _stale_groups(cluster: Any) -> dict[str, int]:
    """What the live scheduler's rule for unconsumable groups did (GetStatus, as an operator)."""
    from gyre.grpcx.channel import dial
    from gyre.identity import Role
    from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc

    channel = dial(cluster.procs["scheduler"].target, cluster.pki.tls("operator"), Role.SCHEDULER)
    try:
        st = await scheduler_pb2_grpc.SchedulerControlStub(channel).GetStatus(
            scheduler_pb2.GetStatusRequest(), timeout=10.0
        )
    finally:
        await channel.close()
    return {"groups_cancelled": st.groups_cancelled, "groups_restamped": st.groups_restamped}


def run_emulated(
    cfg: SimConfig,
    scenario: ScenarioConfig,
    *,
    cells: int | None = None,
    time_scale: float = 10.0,
    tolerance: float = 0.2,
    run_dir: str | Path | None = None,
    ready_timeout_s: float = 180.0,
    run_timeout_s: float = 600.0,
    keep_run_dir: bool = False,
    policy: str = "waterlevel",
) -> EmulationResult:
    """Runs ``scenario`` (at ``cells`` elastic cells, default the scenario's) on the real
    services, time-scaled by 1/``time_scale``, and the simulator on the identical scenario;
    ``ran=False`` with the reason when the services are missing or the run failed."""
    missing = missing_services()
    if missing:
        return EmulationResult(False, "services missing: " + ", ".join(missing), tolerance=tolerance)
    if cells is not None and cells != scenario.cluster.cells:
        cfg, scenario = apply_variant(cfg, scenario, [f"scenario.cluster.cells={cells}"])
    sc = scenario
    n = sc.training.updates
    from apps.launch import Cluster

    model = ensure_model()
    own_dir = run_dir is None
    base = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="gyre-emulate-"))
    base.mkdir(parents=True, exist_ok=True)
    template = base / "emulate.template.yaml"
    template.write_text(
        yaml.safe_dump(
            render_config(cfg, sc, time_scale=time_scale, model_dir=str(model), policy=policy),
            sort_keys=False,
        )
    )
    wall0 = time.monotonic()
    cluster = Cluster(template, base / "run", free_ports=True)
    common: dict[str, Any] = dict(
        tolerance=tolerance,
        cells=sc.cluster.cells,
        updates=n,
        time_scale=time_scale,
        scenario=sc.model_dump(),
        policy=policy,
    )
    try:
        cluster.start()
        conf = cluster.config
        conf["scheduler"]["_target"] = cluster.procs["scheduler"].target
        conf["router"]["_target"] = cluster.procs["router"].target
        times, stats = asyncio.run(_emulate(cluster, cfg, sc, time_scale, ready_timeout_s, run_timeout_s))
        stats.update(asyncio.run(_stale_groups(cluster)))
    except Exception as exc:  # the reason is the result: a failed run is reported, not raised
        return EmulationResult(
            False, f"emulation failed: {type(exc).__name__}: {exc}", wall_s=time.monotonic() - wall0, **common
        )
    finally:
        cluster.stop()
        if own_dir and not keep_run_dir:
            shutil.rmtree(base, ignore_errors=True)
    wall = time.monotonic() - wall0
    sim_res = simulate(cfg, sc, policy)
    emu_times = [t * time_scale for t in times]
    if len(times) < n:
        return EmulationResult(
            False,
            f"reached {len(times)} of {n} updates within {run_timeout_s:g} s",
            simulated_time_to_n_s=sim_res.time_to_n_s,
            wall_s=wall,
            emulated_update_times_s=emu_times,
            simulated_update_times_s=list(sim_res.update_times_s),
            replay=stats,
            **common,
        )
    emu, simt = emu_times[-1], float(sim_res.time_to_n_s)
    rel = (emu - simt) / simt if simt > 0 else float("nan")
    return EmulationResult(
        True,
        "ran",
        emulated_time_to_n_s=emu,
        simulated_time_to_n_s=simt,
        relative_difference=rel,
        simulated_reroutes=int(sim_res.reroutes) + int(sim_res.migrations),
        simulated_stale_groups=(int(sim_res.dropped_groups), int(sim_res.restamped_groups)),
        wall_s=wall,
        emulated_update_times_s=emu_times,
        simulated_update_times_s=list(sim_res.update_times_s),
        replay=stats,
        **common,
    )


EMULATE_BEGIN = "<!-- BEGIN EMULATION RESULTS (generated by bench/cluster.py --emulate) -->"
EMULATE_END = "<!-- END EMULATION RESULTS -->"


def emulation_markdown(results: list[EmulationResult], scenario_label: str) -> str:
    """The agreement table of one or more emulated runs (one per time scale)."""
    lines = [
        "### Simulator vs emulated cluster",
        "",
        f"Scenario: {scenario_label}. The emulated cluster is the real services (etcd, scheduler, "
        "router, packer, elastic cell agents with mock engines and the cost-model trainer) playing the "
        f"same trace; the real scheduler and the simulator run the same policy "
        f"({', '.join(sorted({r.policy for r in results})) or 'waterlevel'}) on the identical scenario and cell "
        "count. Emulated time = wall time x time scale.",
        "",
        "| cells | updates | time scale | emulated time to N | simulated time to N | difference | "
        "tolerance | within | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ran:
            lines.append(f"| {r.cells} | {r.updates} | 1/{r.time_scale:g} | not run: {r.reason} | | | | | |")
            continue
        lines.append(
            f"| {r.cells} | {r.updates} | 1/{r.time_scale:g} | {r.emulated_time_to_n_s:,.0f} s | "
            f"{r.simulated_time_to_n_s:,.0f} s | {r.relative_difference:+.1%} | ±{r.tolerance:.0%} | "
            f"{'yes' if r.within_tolerance else 'no'} | {r.wall_s:.0f} s |"
        )
    lines += [
        "",
        "Where the two can differ, and why: (1) the emulator's own overhead: every engine step is a "
        "Python event-loop turn plus gRPC chunks through the router on a shared 2-core machine, which "
        "dilates emulated time more the larger the time scale (so the smallest scale is the most "
        "faithful); (2) fixed wall-clock latencies of the real services (the scheduler's 50 ms control "
        "tick, the packer's 0.25 s ready grace for late turn records, RPC round trips), which count "
        "x time scale in emulated time and do not exist in the simulator; (3) the scheduler rounds the "
        "over-provision (`round(op x B)` extra groups) where the simulator takes the ceiling: they agree "
        "only when `op x B` is whole (the scaled scenario keeps it whole); (4) group members get the "
        "trace's episodes in acquisition order (same episodes per group, possibly on other engines).",
    ]
    for r in results:
        if r.ran:
            rule = r.scenario.get("training", {}).get("stale_rule", "cancel")
            emu = ", ".join(f"{t:.0f}" for t in r.emulated_update_times_s)
            sim = ", ".join(f"{t:.0f}" for t in r.simulated_update_times_s)
            lines.append("")
            lines.append(
                f"Update times at 1/{r.time_scale:g} (s): emulated {emu}; simulated {sim}. "
                f"Replay: {r.replay.get('finished', 0)} executions finished, "
                f"{r.replay.get('failed', 0)} failed, {r.replay.get('cancelled', 0)} cancelled by the "
                f"scheduler's staleness rule, {r.replay.get('turns', 0)} turns, "
                f"{r.replay.get('reroutes', 0)} calls continued on another engine (reroutes and "
                f"migrations as the harnesses saw them); the simulator rerouted or migrated "
                f"{r.simulated_reroutes} executions. The rule for unconsumable groups ({rule}): the live "
                f"scheduler cancelled {r.replay.get('groups_cancelled', '—')} groups and restamped "
                f"{r.replay.get('groups_restamped', '—')}, the simulator cancelled or dropped "
                f"{r.simulated_stale_groups[0]} and restamped {r.simulated_stale_groups[1]}."
            )
    return "\n".join(lines) + "\n"


def write_emulation_doc(doc: Path, section: str) -> None:
    """Replaces the emulation section of ``doc`` (between its own markers), appending it
    after the generated cluster results the first time; other text is kept."""
    text = doc.read_text() if doc.exists() else "# Cluster benchmark\n"
    block = EMULATE_BEGIN + "\n" + section + "\n" + EMULATE_END
    if EMULATE_BEGIN in text:
        head, rest = text.split(EMULATE_BEGIN, 1)
        tail = rest.split(EMULATE_END, 1)[1] if EMULATE_END in rest else ""
        doc.write_text(head + block + tail)
        return
    marker = "<!-- END CLUSTER RESULTS -->"
    if marker in text:
        head, tail = text.split(marker, 1)
        doc.write_text(head + marker + "\n\n" + block + "\n" + tail)
    else:
        doc.write_text(text.rstrip() + "\n\n" + block + "\n")
