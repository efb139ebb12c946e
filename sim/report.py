"""The cluster benchmark's report: results tables in Markdown and the allocation/waterlevel
plots (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from sim.bench import ScenarioResult
from sim.metrics import RunResult


def _f(x: float, nd: int = 0) -> str:
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return "—"
    return f"{x:,.{nd}f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def plot_scenario(res: ScenarioResult, out_dir: Path) -> Path:
    """Allocation (cells in rollout / training / switching) and waterlevel vs capacity over
    time, one panel per policy: waterlevel, colocated, oracle static."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in (res.main, res.oracle_async_static, res.oracle_static) if r is not None]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.1 * len(runs)), sharex=False, squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        ts = r.timeseries
        if not ts:
            continue
        t = [s["t"] / 60 for s in ts]
        ax.stackplot(
            t, [s["training"] for s in ts], [s["switching"] for s in ts], [s["rollout"] for s in ts],
            labels=["training", "switching", "rollout"], colors=["#d95f02", "#999999", "#1b9e77"],
            step="post", alpha=0.85,
        )
        ax.set_ylabel("cells")
        ax.set_ylim(0, r.cells)
        ax2 = ax.twinx()
        ax2.step(t, [s["waterlevel"] for s in ts], where="post", color="#1f3a93", lw=1.2, label="waterlevel W")
        ax2.step(t, [s["capacity"] for s in ts], where="post", color="#7570b3", lw=0.8, ls="--", label="capacity")
        ax2.set_ylabel("executions")
        for u in r.update_times_s:
            ax.axvline(u / 60, color="k", lw=0.4, alpha=0.4)
        ax.set_title(f"{res.scenario.name}: {r.label}  (time to {res.scenario.training.updates} updates "
                     f"{r.time_to_n_s / 60:.0f} min; thin lines: updates)", fontsize=9, loc="right")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="lower left", bbox_to_anchor=(0.0, 1.12), fontsize=7, ncol=5,
                  frameon=False)
    axes[-1, 0].set_xlabel("simulated time (min)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cluster_{res.scenario.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row(res: ScenarioResult, r: RunResult) -> str:
    wl = res.main
    sp = (r.time_to_n_s / wl.time_to_n_s) if (wl is not None and r.reached and wl.reached) else float("nan")
    eff = res.bound.t_star_s / r.time_to_n_s if r.reached else 0.0
    lat = r.episode_latency_s
    return (
        f"| {r.label} | {_f(r.time_to_n_s)} | {_f(sp, 2)}× | {eff:.2f} | {_pct(r.trainer_idle_ratio)} | "
        f"{_pct(r.rollout_idle_ratio)} | {r.role_switches} ({_f(r.role_switch_gpu_s)}) | "
        f"{r.reroutes} | {r.staleness_mean:.2f} / {_pct(r.stale_token_fraction)} / {r.dropped_groups} | "
        f"{_f(lat.get('p50', 0))} / {_f(lat.get('p90', 0))} / {_f(lat.get('p99', 0))} |"
    )


def _gpu_row(r: RunResult) -> str:
    g = r.gpu_s
    tot = r.cell_seconds or 1.0
    idle = g["idle_rollout"] + g["idle_train"]
    return (
        f"| {r.label} | {_pct(g['decode'] / tot)} | {_pct(g['prefill'] / tot)} | {_pct(g['train'] / tot)} | "
        f"{g['weight_sync'] / tot * 100:.2f}% | {g['role_switch'] / tot * 100:.2f}% | {_pct(idle / tot)} "
        f"({_pct(g['idle_rollout'] / tot)} / {_pct(g['idle_train'] / tot)}) | {_f(tot)} |"
    )


def scenario_markdown(res: ScenarioResult, img_rel: str) -> str:
    sc = res.scenario
    b = res.bound
    h = res.headline()
    tr = sc.training
    lines = [
        f"### {sc.name}: profile {sc.profile}, {sc.cluster.cells} cells, {tr.updates} updates",
        "",
        f"Batch {tr.batch_groups} groups (over-provision {tr.overprovision:.0%} for waterlevel and static; "
        f"none for colocated), {sc.cluster.slots_per_cell} slots per cell, placement `{sc.cluster.placement}`, "
        f"staleness bound {tr.max_staleness}, seed {sc.seed}"
        + (f", drift +{sc.drift.growth_per_version:.1%}/version and ×{sc.drift.jump_factor} from v{sc.drift.jump_at_version}"
           if sc.drift.growth_per_version or sc.drift.jump_at_version >= 0 else "")
        + ".",
        "",
        *([f"**Gyre: {h.get('gyre_vs_oracle_async_static', float('nan')):.2f}× vs oracle async static "
           f"({h.get('oracle_async_static', '—')}), {h.get('gyre_vs_oracle_bursty_static', float('nan')):.2f}× vs "
           f"oracle bursty static, {h.get('gyre_vs_colocated', float('nan')):.2f}× vs colocated, "
           f"efficiency T*/T = {h.get('gyre_efficiency_t_star', 0):.2f}, dropped {h.get('gyre_dropped_share', 0):.0%} "
           "of dispatched groups.**", ""] if "gyre_s" in h else []),
        f"**Waterlevel: {h.get('speedup_vs_colocated', float('nan')):.2f}× vs colocated synchronous, "
        f"{h.get('speedup_vs_oracle_static', float('nan')):.2f}× vs oracle static ({h.get('oracle_static', '—')}), "
        f"efficiency T*/T = {h.get('efficiency', 0):.2f}** "
        f"(T* = {_f(b.t_star_s)} s = max(work bound {_f(b.work_bound_s)} s, critical path {_f(b.critical_path_s)} s)).",
        "",
        "| policy | time to N (s) | its time / the main policy's | T*/T | trainer idle | rollout idle | "
        "role switches (GPU-s) | reroutes | version lag per token (mean / stale share) / groups dropped as too stale | "
        "episode p50 / p90 / p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = [res.gyre, res.waterlevel, res.colocated, res.oracle_static, res.oracle_async_static, res.async_lend]
    shown = [r for r in order if r is not None]
    lines += [_row(res, r) for r in shown]
    lines += [_row(res, r) for r in res.variants.values()]
    lines += [
        "",
        "GPU-seconds by category (share of cells × time to N; idle split rollout / training side):",
        "",
        "| policy | decode | prefill | train | weight sync | role switch | idle (rollout / train) | cell-seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_gpu_row(r) for r in shown + list(res.variants.values())]
    if res.sweep:
        lines += ["", "Static split sweep (T training cells of " f"{sc.cluster.cells}): "
                  + ", ".join(f"T={t}: {_f(s)} s" for t, s in res.sweep) + "."]
    if res.async_sweep:
        lines += ["", "Async static sweep (T, placement): "
                  + ", ".join(f"T={t} {p}: {_f(s)} s" for t, p, s in res.async_sweep) + "."]
    lines += ["", f"![allocation and waterlevel, {sc.name}]({img_rel})", ""]
    return "\n".join(lines)
