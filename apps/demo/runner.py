"""`make demo`: the real system end to end on this machine.

1. builds the tiny model (cached under .gyre/models/),
2. starts a private etcd and every service as processes (packer, scheduler, router, a core
   and two satellites as elastic cells, one standalone rollout engine; vLLM-CPU engines and
   torch trainers by default),
3. starts the dashboard service like every other process (``python -m services.dashboard``:
   the live page, with the scheduler's decisions and their reasons), runs the example
   harness (agents with tools on per-execution workspaces) through several bursts, and
   shows live progress read from the dashboard's ``/api/timeline``,
4. writes a run folder with ``summary.json``, ``timeline.png``, ``timeline.json``, the
   cluster config and every process's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import socket
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from apps.checker import Verdict, check_files
from apps.demo.chaos import Chaos
from apps.demo.learning import (
    diagnostics_summary,
    evaluate_version,
    plot_learning,
    reward_by_generating_version,
    separated,
    step_diagnostics,
    versions_to_evaluate,
    write_tensorboard,
)
from apps.demo.moves import moves_from_histories
from apps.docblock import checkout_commit
from apps.harness.env import EVAL_SEED, EnvConfig, eval_tasks
from apps.harness.example import HarnessStats, run_harness
from apps.launch import Cluster
from gyre.errors import GyreError
from services.dashboard.timeline import LEDGER_FIELDS, STATUS_FIELDS
from services.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
HISTORIES = ("scheduler", "packer", "router", "cell_agent")
VLLM_READY_TIMEOUT_S = 300.0
"""How long the launcher (and its supervisor, on a restart) waits for a vLLM cell agent."""


DEMO_ENV = EnvConfig(phase_after=150, phase_time_scale=0.25)
"""The demo's workload: halfway through (150 of the 300 executions the harness starts) its
tools get 5x slower (time_scale 0.05 -> 0.25: the slow tool's median goes from 1 s to 5 s),
as a phase of longer tasks follows shorter ones in real RL; the cells follow it."""

DEMO_OVERRIDES: dict[str, dict[str, Any]] = {"cluster": {"max_staleness": 1}}
"""The demo runs at eta = 1 (the template: eta = 2) with the template's 8 slots per cell.
At eta = 1 the committed work W_eta holds two batches' worth (32 executions), more than the
24 slots rollout has while the core trains: between batches the core breathes out to give
the waiting executions its slots, and comes back when half a batch is ready."""

DEMO_CONCURRENCY = 40
"""Executions the demo's harness runs at once: more than the gate lets out (W_eta <= 32 plus
the over-provision), so every dispatched execution starts and the slots, not the harness,
bound rollout, as with a harness that starts an agent per dispatched execution. (With 16 the
harness held the dispatched work back and no rollout slot was ever scarce.)"""


@dataclass
class DemoOptions:
    engine: str = "vllm"
    bursts: int = 15
    run_dir: Path = field(default_factory=lambda: ROOT / "runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    template: Path = ROOT / "deploy" / "local" / "cluster.yaml"
    dashboard_port: int = 8080
    concurrency: int = DEMO_CONCURRENCY
    timeout_s: float = 540.0
    env: EnvConfig = DEMO_ENV
    config_overrides: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(DEMO_OVERRIDES))
    live: bool = True
    during: Callable[[Cluster], Awaitable[None]] | None = None
    """Runs alongside the harness once the cluster is up (fault injection: kill or pause
    ``cluster.procs[name]``; the supervisor restarts what dies). Cancelled at the end."""
    chaos: Chaos | None = None
    """``--chaos``: its schedule of faults runs as ``during``, the run ends only once every
    fault was injected and survived (or the timeout), and summary.json reports them.
    ``--chaos-repeat``: the schedule repeats until the work is done (then stops at a fault
    boundary)."""
    warm_start: bool = True
    """v0 is the tiny model after a short supervised warm start on expert trajectories
    (apps/model/warmstart.py), so the reward RL adds is measured from a policy that can
    already call tools. Off: the random model (the fault tests, whose engines are mocks)."""
    eval_tasks: int = 32
    """Held-out tasks of the evaluation (never trained on); 0: no evaluation."""
    eval_samples: int = 4
    """Episodes per held-out task and version evaluated."""
    eval_every: int = 4
    """The core keeps every N-th version's weights; each is evaluated after the run, with v0
    and the last version."""


@dataclass
class BurstTally:
    """Per-burst ledger as last seen, to sum dispatched/finished across bursts."""

    dispatched: dict[int, int] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)

    def see(self, ledger: dict[str, Any]) -> None:
        burst = int(ledger.get("burst_id", 0))
        if burst:
            self.dispatched[burst] = max(self.dispatched.get(burst, 0), int(ledger.get("dispatched", 0)))
            self.finished[burst] = max(self.finished.get(burst, 0), int(ledger.get("finished", 0)))


def render_config(opts: DemoOptions, model_dir: Path) -> Path:
    """The demo's cluster config: the template with the model, engine and overrides."""
    data = yaml.safe_load(opts.template.read_text())
    for section in ("router", "cell_agent", "scheduler", "packer"):
        data.setdefault(section, {})
    data["router"]["model_dir"] = str(model_dir)
    data["cell_agent"]["model_dir"] = str(model_dir)
    training = data["cell_agent"].get("training")
    if isinstance(training, dict) and training.get("mode", "torch") == "torch":
        # The core's step scalars beside the demo's own curves (tensorboard --logdir runs/),
        # and every few versions' weights for the held-out evaluation after the run.
        training.setdefault("tensorboard_dir", "{run_dir}/tensorboard/train")
        if opts.eval_tasks and opts.eval_every:
            training.setdefault("keep_versions_every", opts.eval_every)
    data["cell_agent"]["engine"] = opts.engine
    data["scheduler"]["max_bursts"] = opts.bursts
    # The dashboard is the service itself (one dashboard, one behaviour); the launcher gives
    # every loopback port a free one, so its HTTP port travels as an env override instead.
    port = opts.dashboard_port if opts.dashboard_port and port_is_free(opts.dashboard_port) else 0
    for spec in data["launch"]["processes"]:
        if spec["service"] == "dashboard":
            spec["env"] = {**(spec.get("env") or {}), "GYRE_DASHBOARD__HTTP_PORT": str(port)}
    if not any(spec["service"] == "dashboard" for spec in data["launch"]["processes"]):
        data["launch"]["processes"].append(
            {"service": "dashboard", "env": {"GYRE_DASHBOARD__HTTP_PORT": str(port)}}
        )
    # A vLLM cell agent loads its engine for minutes on a loaded machine: a restart by the
    # supervisor waits as long for its ready line (the launcher's 120 s killed vLLM restarts
    # of the chaos demo twice before one came up).
    if opts.engine == "vllm":
        for spec in data["launch"]["processes"]:
            if spec["service"] == "cell_agent":
                spec.setdefault("ready_timeout_s", VLLM_READY_TIMEOUT_S)
    # Operation histories for the checker (python -m apps.checker), one file per service.
    for section in HISTORIES:
        data[section]["history_file"] = f"{{run_dir}}/history/{section}.jsonl"
    deep_update(data, opts.config_overrides)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    (opts.run_dir / "history").mkdir(exist_ok=True)
    out = opts.run_dir / "cluster.template.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def deep_update(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Merges ``overrides`` into ``data`` section by section, nested sections included."""
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(data.get(key), dict):
            deep_update(data[key], value)
        else:
            data[key] = value


def parse_set(item: str) -> dict[str, Any]:
    """``--set cell_agent.training.pipeline_stages=2`` -> ``{"cell_agent": {"training":
    {"pipeline_stages": 2}}}`` (the value read as YAML)."""
    path, sep, raw = item.partition("=")
    keys = [k for k in path.strip().split(".") if k]
    if not sep or len(keys) < 2:
        raise ValueError(f"--set wants SECTION.FIELD=VALUE, got {item!r}")
    out: dict[str, Any] = {keys[-1]: yaml.safe_load(raw)}
    for key in reversed(keys[:-1]):
        out = {key: out}
    return out


def port_is_free(port: int) -> bool:
    """True when ``port`` can be bound on loopback now (the dashboard falls back to any)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class DashboardReader:
    """Reads the dashboard service's ``/api/timeline``: the demo's only view of the run."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.latest: dict[str, Any] | None = None

    async def timeline(self, window_s: float | None = None) -> dict[str, Any] | None:
        """The timeline JSON (the last ``window_s`` seconds of it), or None while unreachable."""
        query = f"?window_s={window_s}" if window_s else ""
        try:
            async with self._session.get(f"{self.url}api/timeline{query}") as resp:
                resp.raise_for_status()
                body: dict[str, Any] = await resp.json()
        except (TimeoutError, aiohttp.ClientError):
            return None
        if body.get("counters"):
            self.latest = status_from_timeline(body)
        return body

    async def close(self) -> None:
        await self._session.close()


def status_from_timeline(body: dict[str, Any]) -> dict[str, Any]:
    """The latest scheduler status, as the dashboard's timeline JSON carries it."""
    c = body["counters"]
    return {
        **{k: c[k] for k in STATUS_FIELDS if k in c},
        "ledger": {k: c[k] for k in LEDGER_FIELDS if k in c},
        "total": {k: c.get(f"total_{k}", 0) for k in ("dispatched", "finished")},
        "cells": [cell for cell in body.get("cells", []) if cell.get("state") != "GONE"],
    }


def build_model(console: Console) -> Path:
    from apps.model.tiny import build_tiny_model

    with console.status("building the tiny model (Qwen2 architecture, byte-level BPE, ChatML) ..."):
        path = build_tiny_model(ROOT / ".gyre" / "models" / "tiny-seed0", seed=0)
    console.print(f"[green]model[/] {path}")
    return path


def _progress_view(
    status: dict[str, Any] | None,
    stats: HarnessStats,
    tally: BurstTally,
    elapsed_s: float,
    dashboard_url: str,
) -> Any:
    if status is None:
        return Panel("waiting for the scheduler ...", title="gyre demo")
    ledger = status["ledger"]
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]burst[/] {ledger['burst_id']}",
        f"[bold]W[/] {ledger['waterlevel']} (Q {ledger['queued']} + R {ledger['running']})",
        f"[bold]capacity[/] {status['capacity']}",
        f"[bold]ready[/] {status['ready_groups']}/{status['batch_size']}",
        f"[bold]policy[/] v{status['policy_version']}",
        f"[bold]reroutes[/] {status['reroutes']}",
        f"[bold]moves[/] {status['transitions_to_training']}→train {status['transitions_to_rollout']}→rollout",
        f"{elapsed_s:5.0f} s",
    )
    cells = Table(box=None, pad_edge=False)
    for col in ("cell", "role", "state", "slots", "routed", "version"):
        cells.add_column(col)
    colors = {"ROLLOUT": "blue", "TRAINING": "red", "DRAINING": "yellow", "RETURNING": "magenta"}
    for cell in status["cells"]:
        state = cell["state"]
        role = (
            "standalone"
            if cell["kind"] == "STANDALONE"
            else ("core" if cell["index"] == 0 else f"satellite {cell['index']}")
        )
        cells.add_row(
            cell["cell_id"],
            role,
            f"[{colors.get(state, 'white')}]{state.lower()}",
            str(cell["slots"]),
            str(cell["routed"]),
            f"v{cell['policy_version']}",
        )
    rewards = reward_by_version(stats)
    rew = "  ".join(f"v{v}: {r['mean']:.3f} (n={r['n']})" for v, r in sorted(rewards.items())) or "-"
    foot = (
        f"executions: dispatched {sum(tally.dispatched.values())}, finished {sum(tally.finished.values())}; "
        f"harness completed {stats.completed}, failed {stats.failed}\n"
        f"reward by dispatch version: {rew}\ndashboard: {dashboard_url}"
    )
    return Panel(Group(head, cells, foot), title="gyre demo")


def reward_by_version(stats: HarnessStats) -> dict[int, dict[str, float]]:
    groups: dict[int, list[float]] = defaultdict(list)
    for version, reward in stats.rewards:
        groups[version].append(reward)
    return {v: {"mean": sum(r) / len(r), "n": len(r)} for v, r in groups.items()}


async def run_demo(opts: DemoOptions) -> dict[str, Any]:
    from apps.demo.plot import plot_timeline

    console = Console()
    started, started_wall = time.monotonic(), time.time()
    commit = checkout_commit()  # now: a commit made while the demo runs is not what it ran
    model_dir = build_model(console)
    loop = asyncio.get_running_loop()
    if opts.warm_start:
        model_dir = await loop.run_in_executor(None, warm_start_model, console, model_dir)
    held_out = eval_tasks(opts.eval_tasks) if opts.eval_tasks else []
    evals: list[dict[str, Any]] = []
    if held_out:
        with console.status(f"evaluating v0 on {len(held_out)} held-out tasks ..."):
            evals.append(await loop.run_in_executor(None, _evaluate, opts, model_dir, None, 0, held_out))
        _print_eval(console, evals[-1])
    template = render_config(opts, model_dir)
    cluster = Cluster(template, opts.run_dir, free_ports=True)
    end = RunEnd(opts.bursts, planned_executions(cluster.section("scheduler")))
    console.print(f"run folder: {opts.run_dir}")
    await loop.run_in_executor(
        None,
        lambda: cluster.start(
            progress=lambda name, target: console.print(f"[green]started[/] {name:<10} {target}")
        ),
    )
    stats = HarnessStats()
    tally = BurstTally()
    stop = asyncio.Event()
    url = str(cluster.procs["dashboard"].ready_info["url"])
    dashboard = DashboardReader(url)
    console.print(f"[green]dashboard[/] {url}")
    harness: asyncio.Task[HarnessStats] | None = None
    inject = opts.chaos.run if opts.chaos is not None else opts.during
    during: asyncio.Future[None] | None = (
        asyncio.ensure_future(inject(cluster)) if inject is not None else None
    )
    outcome = "completed"
    try:
        harness = asyncio.create_task(
            run_harness(
                cluster.procs["scheduler"].target,
                opts.env,
                opts.concurrency,
                stop_when_exhausted=False,
                harness_id="demo",
                stop=stop,
                stats=stats,
                tls_dir=None if cluster.pki.insecure else str(cluster.pki.identity_dir("harness")),
                insecure=cluster.pki.insecure,
            )
        )
        with Live(
            _progress_view(None, stats, tally, 0, url),
            console=console,
            refresh_per_second=2,
            transient=not opts.live,
        ) as live:
            while True:
                await asyncio.sleep(0.5)
                await dashboard.timeline(window_s=1)
                status = dashboard.latest
                if status is not None:
                    tally.see(status["ledger"])
                live.update(_progress_view(status, stats, tally, time.monotonic() - started, url))
                if harness.done():
                    harness.result()  # re-raise a harness failure
                    break
                if cluster.dead():  # restarted too often: the supervisor gave up
                    outcome = f"process given up on: {', '.join(cluster.dead())}"
                    break
                work_done = status is not None and end.done(status, time.monotonic())
                if work_done and opts.chaos is not None:
                    opts.chaos.finish()  # a repeating schedule stops at its next fault boundary
                faults_pending = opts.chaos is not None and during is not None and not during.done()
                if work_done and not faults_pending:
                    break
                if time.monotonic() - started > opts.timeout_s:
                    outcome = f"timed out after {opts.timeout_s:.0f} s"
                    break
        stop.set()
        if harness is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(harness), 30)
        await asyncio.sleep(1.5)  # the dashboard polls every 0.5 s: let it see the last status
        timeline = await dashboard.timeline() or {}
        packer_log = await _packer_log(cluster, opts.run_dir / "packer-wal")
    finally:
        stop.set()
        if harness is not None and not harness.done():
            harness.cancel()
        if during is not None and not during.done():
            during.cancel()
        await dashboard.close()
        await loop.run_in_executor(None, cluster.stop)

    final = dashboard.latest or {}
    if final:
        tally.see(final["ledger"])
    dispatched = sum(tally.dispatched.values())
    finished = sum(tally.finished.values())
    total = final.get("total") or {}
    if total.get("dispatched"):
        # SchedulerStatus.total sums every burst; the per-burst tally misses stragglers of
        # an earlier burst that close after the next one is dispatched (status.ledger is the
        # current burst only), and reported them as lost.
        dispatched, finished = int(total["dispatched"]), int(total["finished"])
    rewards = reward_by_version(stats)
    versions = sorted(rewards)
    verdict = _check_histories(opts.run_dir, complete=outcome == "completed")
    chaos = opts.chaos.summary() if opts.chaos is not None else None
    if chaos is not None and outcome == "completed" and chaos["survived"] < chaos["scheduled"]:
        outcome = f"faults survived {chaos['survived']} of {chaos['scheduled']} scheduled"
    if outcome == "completed" and not verdict.ok:
        outcome = f"history checker: {len(verdict.violations)} violations"
    trajectories = {**_trajectories(packer_log.events), "read_from": packer_log.source}
    # What the policy learned: every kept version and the last, on the held-out tasks.
    if held_out:
        kept = versions_to_evaluate(opts.run_dir)
        for n, (version, state) in enumerate(kept.items(), 1):
            with console.status(
                f"evaluating v{version} ({n}/{len(kept)}) on {len(held_out)} held-out tasks ..."
            ):
                evals.append(
                    await loop.run_in_executor(None, _evaluate, opts, model_dir, state(), version, held_out)
                )
            _print_eval(console, evals[-1])
    generated = reward_by_generating_version(packer_log.events)
    steps = step_diagnostics(opts.run_dir / "history" / "cell_agent.jsonl")
    learning = {
        "eval": _eval_summary(evals, opts),
        "reward_by_generating_version": {str(v): r for v, r in generated.items()},
        "training": diagnostics_summary(steps),
    }
    summary = {
        "outcome": outcome,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started_wall)),
        "commit": commit,
        "engine": opts.engine,
        "config_overrides": opts.config_overrides,  # what the run changed in the template (--set)
        "wall_s": round(time.monotonic() - started, 1),
        "bursts": final.get("bursts_completed", 0),
        "policy_versions_published": final.get("policy_version", 0),
        # From the histories, not the scheduler's counters: a failover resets those.
        **moves_from_histories(opts.run_dir / "history"),
        "reroutes": final.get("reroutes", 0),
        "executions": {
            "dispatched": dispatched,
            "finished": finished,
            "lost": dispatched - finished,
            "harness_completed": stats.completed,
            "harness_failed": stats.failed,
            "harness_cancelled": stats.cancelled,
            "harness_calls": stats.calls,
        },
        **learning,
        "reward_by_dispatch_version": {str(v): rewards[v] for v in versions},
        "trajectories": trajectories,
        "restarts": {name: n for name, n in cluster.restarts().items() if n},
        "checker": verdict.to_json(),
        **({"chaos": chaos} if chaos is not None else {}),
        "process_events": [e.to_json() for e in cluster.events()],
    }
    (opts.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (opts.run_dir / "timeline.json").write_text(json.dumps(timeline))
    if evals or generated:
        plot_learning(evals, generated, opts.run_dir / "learning.png", steps)
        write_tensorboard(opts.run_dir / "tensorboard" / "demo", evals, generated)
    plot_timeline(
        timeline,
        opts.run_dir / "timeline.png",
        title=f"Gyre demo ({opts.engine} engines): roles, waterlevel and capacity",
    )
    _print_summary(console, summary, opts.run_dir)
    return summary


def warm_start_model(console: Console, model_dir: Path) -> Path:
    """v0: the tiny model after the supervised warm start (cached beside it)."""
    from apps.model.warmstart import warm_start

    with console.status("warm start: supervised fine-tune on expert trajectories (v0) ..."):
        t0 = time.monotonic()
        path = warm_start(model_dir)
    console.print(f"[green]v0[/] {path} ({time.monotonic() - t0:.0f} s)")
    return path


def _evaluate(opts: DemoOptions, v0_dir: Path, state: Any, version: int, tasks: list[Any]) -> dict[str, Any]:
    return evaluate_version(v0_dir, state, version, tasks, opts.env, opts.eval_samples, seed=EVAL_SEED)


def _print_eval(console: Console, e: dict[str, Any]) -> None:
    console.print(
        f"[green]eval[/] v{e['version']}: {e['mean']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}] "
        f"(n={e['n']}, success {e['success']:.2f}, {e['seconds']:.0f} s)"
    )


def _eval_summary(evals: list[dict[str, Any]], opts: DemoOptions) -> dict[str, Any]:
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    return {
        "tasks": opts.eval_tasks,
        "samples_per_task": opts.eval_samples,
        "first": first,
        "last": last,
        "by_version": evals,
        "last_above_first": separated(first, last),
    }


def _eval_row(e: dict[str, Any]) -> str:
    if not e:
        return "-"
    parts = [
        f"v{x['version']}: {x['mean']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]" for x in e["by_version"]
    ]
    verdict = "last above first (intervals apart)" if e["last_above_first"] else "intervals overlap"
    return ", ".join(parts) + f"; {verdict}"


def _diag_row(t: dict[str, Any]) -> str:
    if not t:
        return "-"
    m = t["mean"]
    return (
        f"{t['steps']} steps: clip {m['clip_fraction']:.3f}, behaviour weight {m['behaviour_weight_mean']:.3f} "
        f"(max {t['behaviour_weight_max']:.2f}, capped {m['behaviour_weight_capped_share']:.4f}), "
        f"entropy {m['entropy']:.3f}, grad norm {m['grad_norm']:.3f}, lag {m['lag_mean']:.2f}, "
        f"gap at lag 0 {m['logprob_gap_lag0']:.4f}"
    )


def planned_executions(section: dict[str, Any]) -> int:
    """Executions the scheduler's task supply holds (``max_bursts`` bursts' worth of groups),
    0 when unbounded."""
    cfg = SchedulerConfig(**{k: v for k, v in section.items() if k in SchedulerConfig.model_fields})
    return cfg.max_bursts * cfg.groups_per_burst() * cfg.group_size


class RunEnd:
    """When the demo's work is done, however the scheduler's policy grouped it into bursts.

    Done when ``bursts`` bursts completed (their versions published); or when every planned
    task was dispatched and finished (the asynchronous policies may dispatch several bursts'
    worth at once, so ``bursts`` may never complete) and the trainer has used that data:
    every dispatched burst completed, or no full batch is left and the policy version held
    still for ``settle_s`` (a last burst whose data cannot fill its batches never completes).
    Never before the first update: an RL demo that ends while a killed core's training
    recovers has not done its work. The drained case used to end the run right after the
    first update, while the last burst's batch was still training (a sync run published 1
    version of 2)."""

    def __init__(self, bursts: int, planned: int, settle_s: float = 30.0) -> None:
        self.bursts = bursts
        self.planned = planned
        self.settle_s = settle_s
        self._version = -1
        self._since = 0.0

    def done(self, status: dict[str, Any], now_s: float) -> bool:
        version = int(status.get("policy_version", 0))
        if version != self._version:
            self._version, self._since = version, now_s
        if status["ledger"]["waterlevel"] != 0:
            return False
        completed = int(status["bursts_completed"])
        total = status.get("total") or {}
        drained = (
            self.planned > 0
            and int(total.get("dispatched", 0)) >= self.planned
            and int(total.get("finished", 0)) >= int(total.get("dispatched", 0))
        )
        if completed >= self.bursts and (self.planned <= 0 or drained):
            # With a known task supply, every execution must have finished too: at eta = 1
            # bursts are small, 15 of them completed while 25 dispatched executions had not
            # even launched, and the run ended with them counted as lost.
            return True
        if not drained or completed < 1:
            return False
        if completed >= int(status["ledger"].get("burst_id", 0)):
            return True
        no_batch_left = int(status.get("ready_groups", 0)) < max(1, int(status.get("batch_size", 1)))
        return no_batch_left and now_s - self._since >= self.settle_s


def _check_histories(run_dir: Path, complete: bool) -> Verdict:
    """The history checker (apps/checker) over the services' histories of this run."""
    paths = [p for p in (run_dir / "history" / f"{s}.jsonl" for s in HISTORIES) if p.exists()]
    return check_files(paths, complete=complete)


def _chaos_row(chaos: dict[str, Any] | None) -> str:
    if chaos is None:
        return "none (--chaos injects them)"
    faults = ", ".join(
        f"{f['kind']} {f['target']}{' ok' if f['survived'] else ' NOT SURVIVED'}" for f in chaos["faults"]
    )
    return f"{chaos['survived']} survived of {chaos['injected']} injected ({chaos['scheduled']} scheduled): {faults}"


def _consistency(t: dict[str, Any]) -> str:
    if not t.get("consecutive_turn_pairs"):
        return "-"
    return (
        f"{t['token_consistent_pairs']} / {t['consecutive_turn_pairs']} ({100 * t['token_consistent_share']:.1f}%), "
        f"{t['segment_breaks']} segment breaks, {t['segments_per_episode']} segments per episode"
    )


def _tokens(t: dict[str, Any]) -> str:
    if not t.get("executions"):
        return "-"
    return f"{t['training_tokens_per_episode']} / {t['per_turn_tokens_per_episode']}"


def _trajectories(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Token consistency and training tokens, from the packer's log (apps/demo/trajectories.py)."""
    from apps.demo.trajectories import analyze

    return analyze(events) if events else {}


@dataclass
class PackerLog:
    events: list[dict[str, Any]]
    source: str
    """Where they came from: the packer's API, or its WAL file when the packer did not answer."""


async def _packer_log(cluster: Cluster, wal_dir: Path) -> PackerLog:
    """The packer's event log, through its API as an operator while the services are up; its
    WAL file only when the packer does not answer (it was given up on)."""
    from apps.demo.trajectories import read_events, read_log

    try:
        return PackerLog(await read_log(cluster.procs["packer"].target, cluster.pki.tls("operator")), "api")
    except (GyreError, grpc.RpcError, OSError) as exc:
        log.warning(
            "the packer's log through its API failed; reading its WAL file", extra={"error": repr(exc)}
        )
    try:
        return PackerLog(read_events(wal_dir), "wal file")
    except FileNotFoundError:
        return PackerLog([], "none")


def _print_summary(console: Console, summary: dict[str, Any], run_dir: Path) -> None:
    table = Table(title="summary", show_header=False)
    ex = summary["executions"]
    rows = [
        ("outcome", summary["outcome"]),
        ("bursts", summary["bursts"]),
        ("policy versions published", summary["policy_versions_published"]),
        (
            "transitions rollout→training / training→rollout",
            f"{summary['transitions_to_training']} / {summary['transitions_to_rollout']}"
            f" ({summary['satellite_joins']} satellite joins)",
        ),
        ("reroutes", summary["reroutes"]),
        (
            "processes restarted (supervisor)",
            ", ".join(f"{k} x{v}" for k, v in summary["restarts"].items()) or "none",
        ),
        ("faults injected", _chaos_row(summary.get("chaos"))),
        (
            "history checker",
            "ok" if summary["checker"]["ok"] else "; ".join(summary["checker"]["violations"][:5]),
        ),
        ("executions dispatched / finished / lost", f"{ex['dispatched']} / {ex['finished']} / {ex['lost']}"),
        ("episodes completed / failed (harness)", f"{ex['harness_completed']} / {ex['harness_failed']}"),
        ("held-out eval (mean [95% CI])", _eval_row(summary.get("eval") or {})),
        (
            "training reward by generating version",
            ", ".join(f"v{v}: {r['mean']:.2f}" for v, r in summary["reward_by_generating_version"].items())
            or "-",
        ),
        ("training diagnostics (mean per step)", _diag_row(summary.get("training") or {})),
        ("token-consistent consecutive turns", _consistency(summary.get("trajectories") or {})),
        ("training tokens per episode (per segment / per turn)", _tokens(summary.get("trajectories") or {})),
        ("wall time", f"{summary['wall_s']} s"),
        ("run folder", str(run_dir)),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)
