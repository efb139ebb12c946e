"""The cluster benchmark's report: the summary across seeds, per-scenario tables in Markdown,
and the allocation / waterlevel plots (matplotlib, Agg)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from sim.bench import ScenarioResult
from sim.config import SimConfig
from sim.metrics import RunResult

ROLE_NAMES = {
    "gyre": "Gyre",
    "oracle_async_static": "oracle async static",
    "prior_static": "prior static",
    "half_static": "50:50 static",
    "oracle_bursty_static": "oracle bursty static",
    "colocated": "colocated sync",
}


PLOT_ROLES = ("gyre", "oracle_async_static", "oracle_bursty_static", "colocated")
"""The rows the allocation plot shows (one panel each)."""


def _f(x: float | None, nd: int = 0) -> str:
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return "—"
    return f"{x:,.{nd}f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _spread_x(s: list[float | None]) -> str:
    lo, med, hi = s
    if med is None:
        return "—"
    return f"**{med:.2f}×** ({lo:.2f}–{hi:.2f})"


def role_name(role: str) -> str:
    return ROLE_NAMES.get(role, role.replace("_", " "))


def plot_scenario(res: ScenarioResult, out_dir: Path) -> Path:
    """Allocation (cells in rollout / training / switching) and waterlevel vs capacity over
    time, one panel per row of the summary (Gyre and its baselines) that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(role, r) for role in PLOT_ROLES if (r := res.run(role)) is not None and r.timeseries]
    fig, axes = plt.subplots(max(1, len(runs)), 1, figsize=(10, 3.1 * max(1, len(runs))), squeeze=False)
    for ax, (role, r) in zip(axes[:, 0], runs):
        ts = r.timeseries
        t = [s["t"] / 60 for s in ts]
        ax.stackplot(
            t,
            [s["training"] for s in ts],
            [s["switching"] for s in ts],
            [s["rollout"] for s in ts],
            labels=["training", "switching", "rollout"],
            colors=["#d95f02", "#999999", "#1b9e77"],
            step="post",
            alpha=0.85,
        )
        ax.set_ylabel("cells")
        ax.set_ylim(0, r.cells)
        ax2 = ax.twinx()
        ax2.step(
            t, [s["waterlevel"] for s in ts], where="post", color="#1f3a93", lw=1.2, label="waterlevel W"
        )
        ax2.step(
            t, [s["capacity"] for s in ts], where="post", color="#7570b3", lw=0.8, ls="--", label="capacity"
        )
        ax2.set_ylabel("executions")
        for u in r.update_times_s:
            ax.axvline(u / 60, color="k", lw=0.4, alpha=0.4)
        ax.set_title(
            f"{res.scenario.name} seed {res.scenario.seed}: {role_name(role)} = {r.label} (time to "
            f"{res.scenario.training.updates} updates {r.time_to_n_s / 60:.0f} min; thin lines: updates)",
            fontsize=9,
            loc="right",
        )
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(
            h1 + h2, l1 + l2, loc="lower left", bbox_to_anchor=(0.0, 1.12), fontsize=7, ncol=5, frameon=False
        )
    axes[-1, 0].set_xlabel("simulated time (min)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cluster_{res.scenario.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratios(summary: dict[str, dict[str, Any]], key: str) -> list[float]:
    return [v for s in summary.values() if isinstance(v := s.get(key), float | int)]


SWITCH_PREFIX = "vs_oracle_async_static_switch_x"
"""Summary keys of the switch-cost sensitivity (one per factor)."""


def headline_markdown(summary: dict[str, dict[str, Any]], switch_key: str | None) -> str:
    """The page's opening table: Gyre against the hindsight oracle and the baselines a user
    has (prior static, 50:50), the switch-cost sensitivity, KV pressure and the simulator's
    cost per scenario; then the issue's checks over the scenarios. Without ``switch_key`` (a
    suite without the switch rows, merged into the file) the summary's own switch key, if any:
    the rows of earlier suites keep their column."""
    if switch_key is None:
        switch_key = next((k for s in summary.values() for k in s if k.startswith(SWITCH_PREFIX)), None)
    sw = f" | vs oracle, switch ×{switch_key.removeprefix(SWITCH_PREFIX)}" if switch_key else ""
    lines = [
        "| scenario | cells | seeds | Gyre (s) | vs oracle async static (hindsight) | vs prior static | "
        f"vs 50:50 static{sw} | preemptions / prefix evictions | decide() p50 / p99 (ms) | "
        "simulator wall per Gyre run (s) |",
        "|---|---:|---|---:|---:|---:|---:|" + ("---:|" if switch_key else "") + "---:|---:|---:|",
    ]
    for name, s in summary.items():
        sp = s.get("spread", {})
        cells = [
            name,
            str(s.get("cells", "—")),
            ",".join(map(str, s.get("seeds", []))),
            _f(s.get("gyre_s")),
            _spread_x(sp.get("vs_oracle_async_static", [None, s.get("vs_oracle_async_static"), None])),
            _spread_x(sp.get("vs_prior_static", [None, s.get("vs_prior_static"), None])),
            _spread_x(sp.get("vs_half_static", [None, s.get("vs_half_static"), None])),
        ]
        if switch_key:
            cells.append(_x(s.get(switch_key)))
        cells += [
            f"{_f(s.get('preemptions'))} / {_f(s.get('kv_evictions'))}",
            f"{_f(s.get('decide_ms_p50'), 2)} / {_f(s.get('decide_ms_p99'), 2)}",
            _f(s.get("gyre_sim_wall_s")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    checks = [
        ("vs_oracle_async_static", "median ≥ 1.00, worst ≥ 0.97", 1.00, 0.97),
        ("vs_prior_static", "median ≥ 1.10", 1.10, None),
        ("vs_half_static", "(no target)", None, None),
    ]
    if switch_key:
        checks.append((switch_key, "worst ≥ 0.95", None, 0.95))
    lines += ["", "Over the scenarios (issue 33's targets):", ""]
    for key, want, med_min, worst_min in checks:
        xs = _ratios(summary, key)
        if not xs:
            lines.append(f"- `{key}`: not measured.")
            continue
        med, worst = statistics.median(xs), min(xs)
        ok = (med_min is None or med >= med_min) and (worst_min is None or worst >= worst_min)
        verdict = "" if med_min is None and worst_min is None else (" — **met**" if ok else " — not met")
        lines.append(
            f"- `{key}`: median {med:.2f}×, worst {worst:.2f}× over {len(xs)} scenarios; target {want}{verdict}."
        )
    b = summary.get("B64-eta0", {}).get("vs_oracle_async_static")
    lines.append(
        f"- B64-eta0 vs its oracle: {_x(b)}; target ≥ 1.15×{' — **met**' if b and b >= 1.15 else ' — not met'}."
    )
    priors = [
        f"{name}: " + "; ".join(s["prior_static_from"])
        for name, s in summary.items()
        if s.get("prior_static_from")
    ]
    if priors:
        lines += [
            "",
            "Prior static split, per scenario and seed (chosen without hindsight on that seed):",
            "",
        ]
        lines += [f"- {p}" for p in priors]
    return "\n".join(lines) + "\n"


def summary_markdown(cfg: SimConfig, summary: dict[str, dict[str, Any]]) -> str:
    """The headline table (medians over seeds, min–max in brackets) and the hygiene table."""
    lines = [
        "### Summary (median over seeds; min–max in brackets; ratios = baseline time / Gyre time)",
        "",
        (
            "| scenario | η | seeds | Gyre (s) | vs oracle async static | vs oracle bursty static | vs colocated | "
            "efficiency T\\*_η/T | efficiency, gate bound | target | met |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, s in summary.items():
        sp = s["spread"]
        tgt = s.get("target")
        want = "—"
        met = "—"
        if tgt is not None:
            want = f"≥ {tgt['ratio']:.2f}× vs {role_name(tgt['baseline'])}"
            if tgt.get("min_efficiency"):
                want += f", efficiency ≥ {tgt['min_efficiency']:.2f}"
            met = "**yes**" if tgt["met"] else "no"
        lines.append(
            f"| {name} | {s['eta']} | {','.join(map(str, s['seeds']))} | {_f(s['gyre_s'])} | "
            f"{_spread_x(sp['vs_oracle_async_static'])} | {_spread_x(sp['vs_oracle_bursty_static'])} | "
            f"{_spread_x(sp['vs_colocated'])} | {_f(s['efficiency_t_star_eta'], 2)} | "
            f"{_f(s.get('efficiency_gate_bound'), 2)} | {want} | {met} |"
        )
    ran = sorted({label for s in summary.values() for label in s["ran"].get("gyre", [])})
    if ran:
        lines += ["", "The Gyre row ran " + ", ".join(f"`{x}`" for x in ran) + "."]
    missing = {(role, why) for s in summary.values() for role, why in s["missing"].items()}
    if missing:
        lines += [
            "",
            "Missing rows: " + "; ".join(f"**{role_name(r)}**: {why}" for r, why in sorted(missing)) + ".",
        ]
    t = cfg.targets
    lines += [
        "",
        (
            f"Hygiene of Gyre's run (median over seeds; limits: dropped ≤ {_pct(t.dropped_share)}, role switch + "
            f"reroute GPU-s ≤ {100 * t.switch_reroute_share:.0f}%, trainer and rollout idle ≤ {_pct(t.trainer_idle)}):"
        ),
        "",
        (
            "| scenario | dropped or cancelled groups / dispatched | switch + reroute GPU-s share | trainer idle | "
            "rollout idle | length bias (consumed / dispatched) | consumed tokens > η versions old | "
            "T\\*_η (s) | gate path (s) | one-burst T\\* (s) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        h, ok = s["hygiene"], s["hygiene_met"]

        def cell(key: str, pct: bool = True, h=h, ok=ok) -> str:
            v = h.get(key)
            txt = _pct(v) if pct else _f(v, 2)
            if key == "switch_reroute_gpu_share" and v is not None:
                txt = f"{100 * v:.2f}%"
            return txt + ("" if ok.get(key) in (None, True) else " ✗")

        lines.append(
            f"| {name} | {cell('dropped_share')} | {cell('switch_reroute_gpu_share')} | {cell('trainer_idle')} | "
            f"{cell('rollout_idle')} | {cell('length_bias', pct=False)} | {cell('beyond_eta_token_share')} | "
            f"{_f(s['t_star_eta_s'])} | "
            f"{_f(s.get('gate_path_s'))} | {_f(s['t_star_one_burst_s'])} |"
        )
    lines += [
        "",
        "Consumed tokens > η versions old: 0 under the cancel rule by construction; — for results "
        "stored before the column existed. Under the partial rule T\\*_η runs with η = N (no "
        "latency window, `sim/bounds.py`).",
    ]
    return "\n".join(lines) + "\n"


def _row(res: ScenarioResult, role: str, r: RunResult) -> str:
    lat = r.episode_latency_s
    eff = res.bound_eta.t_star_eta_s / r.time_to_n_s if r.reached else 0.0
    return (
        f"| {role_name(role)}: {r.label} | {_f(r.time_to_n_s)} | {eff:.2f} | {_pct(r.trainer_idle_ratio)} | "
        f"{_pct(r.rollout_idle_ratio)} | {r.role_switches} ({_f(r.role_switch_gpu_s)}) | "
        f"{r.reroutes} ({_f(r.reroute_gpu_s)}) | {r.staleness_mean:.2f} / {_pct(r.stale_token_fraction)} / "
        f"{r.dropped_groups} | {_f(lat.get('p50', 0))} / {_f(lat.get('p90', 0))} / {_f(lat.get('p99', 0))} |"
    )


def _gpu_row(label: str, r: RunResult) -> str:
    g = r.gpu_s
    tot = r.cell_seconds or 1.0
    idle = g["idle_rollout"] + g["idle_train"]
    return (
        f"| {label} | {_pct(g['decode'] / tot)} | {_pct(g['prefill'] / tot)} | {_pct(g['train'] / tot)} | "
        f"{g['weight_sync'] / tot * 100:.2f}% | {g['role_switch'] / tot * 100:.2f}% | {_pct(idle / tot)} "
        f"({_pct(g['idle_rollout'] / tot)} / {_pct(g['idle_train'] / tot)}) | {_f(tot)} |"
    )


def _sweep_line(res: ScenarioResult) -> list[str]:
    out = []
    for role, rr in res.roles.items():
        if not rr.sweep:
            continue
        pts = ", ".join(
            f"T={p.training_cells}{'' if p.placement == res.scenario.cluster.placement else ' ' + p.placement}: "
            + (_f(p.time_to_n_s) + " s" if p.time_to_n_s is not None else f"> {_f(p.cut_at_s)} s (cut)")
            for p in rr.sweep
        )
        out.append(f"- {role_name(role)} sweep (seed {res.scenario.seed}): {pts}.")
    return out


def scenario_markdown(
    cfg: SimConfig, results: list[ScenarioResult], summary: dict[str, Any], img_rel: str
) -> str:
    """One scenario: setup, every row per seed (times), the first seed's detailed tables,
    the sweeps and the plot."""
    first = results[0]
    sc = first.scenario
    tr = sc.training
    drift = sc.drift
    setup = (
        f"Profile {sc.profile}"
        + (f" mixed with {', '.join(f'{k} ×{w:g}' for k, w in sc.mix.items())}" if sc.mix else "")
        + f", {sc.cluster.cells} cells × {sc.cluster.slots_per_cell} slots, batch {tr.batch_groups} groups "
        f"(over-provision {tr.overprovision:.0%}), η = {tr.max_staleness} ({tr.stale_rule} rule"
        + (
            f", at most {tr.partial_max_versions} versions past dispatch"
            if tr.partial_max_versions is not None
            else ""
        )
        + f"), N = {tr.updates} "
        "updates, placement "
        f"`{sc.cluster.placement}`"
        + (
            f", drift +{drift.growth_per_version:.1%}/version{' (turns too)' if drift.turns_too else ''}"
            + (
                f" and ×{drift.jump_factor} from v{drift.jump_at_version}"
                if drift.jump_at_version >= 0
                else ""
            )
            if drift.growth_per_version or drift.jump_at_version >= 0
            else ""
        )
        + "."
    )
    roles = [p.role for p in cfg.policies]
    lines = [
        f"### {sc.name}",
        "",
        setup,
        "",
        "| row | " + " | ".join(f"seed {r.scenario.seed}" for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for role in roles:
        cells = []
        for r in results:
            run = r.run(role)
            rr = r.roles.get(role)
            if run is None:
                cells.append("missing" if rr is None or rr.policy is None else "—")
            else:
                cells.append(
                    f"{_f(run.time_to_n_s)} s ({run.label})" if role != "gyre" else f"{_f(run.time_to_n_s)} s"
                )
        lines.append(f"| {role_name(role)} | " + " | ".join(cells) + " |")
    lines.append(
        "| T\\*_η (one-burst T\\*) | "
        + " | ".join(f"{_f(r.bound_eta.t_star_eta_s)} s ({_f(r.bound.t_star_s)} s)" for r in results)
        + " |"
    )
    lines += [
        "",
        (
            f"Seed {sc.seed} in detail (T\\*_η = {_f(first.bound_eta.t_star_eta_s)} s; publish times bound by "
            f"{_binding(first)}):"
        ),
        "",
        (
            "| row | time to N (s) | T\\*_η/T | trainer idle | rollout idle | role switches (GPU-s) | "
            "reroutes (GPU-s) | "
            "version lag per token (mean / stale share) / groups dropped | episode p50 / p90 / p99 (s) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shown = [(role, run) for role in roles if (run := first.run(role)) is not None]
    lines += [_row(first, role, run) for role, run in shown]
    lines += [_row(first, "gyre", run) for run in first.variants.values()]
    lines += [
        "",
        "GPU-seconds by category (share of cells × time to N; idle split rollout / training side):",
        "",
        "| row | decode | prefill | train | weight sync | role switch | idle (rollout / train) | cell-seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_gpu_row(f"{role_name(role)}: {run.label}", run) for role, run in shown]
    lines += [_gpu_row(run.label, run) for run in first.variants.values()]
    sweeps = [line for r in results for line in _sweep_line(r)]
    if sweeps:
        lines += ["", (f"Sweeps (training cells T of {sc.cluster.cells}):"), "", *sweeps]
    lines += ["", f"![allocation and waterlevel, {sc.name}]({img_rel})", ""]
    return "\n".join(lines)


def _binding(res: ScenarioResult) -> str:
    counts: dict[str, int] = {}
    for b in res.bound_eta.binding:
        counts[b] = counts.get(b, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
