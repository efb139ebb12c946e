"""timeline.png: cell roles over time, with the waterlevel and capacity beneath, and the open
work per policy version (overlapping bursts) at the bottom."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The live dashboard's palette (services/dashboard/static/index.html), so both read alike.
ROLE_COLORS = {
    "STARTING": "#9aa5b1",
    "ROLLOUT": "#2e9d57",
    "DRAINING": "#f0a020",
    "TRAINING": "#3b6fd8",
    "RETURNING": "#9b59b6",
    "FAILED": "#d64545",
    "GONE": "#e3e6ea",
    "UNKNOWN": "#c4c9cf",
}


def plot_timeline(timeline: dict[str, Any], out: str | Path, title: str = "Gyre demo") -> Path:
    """Draws ``timeline`` (the dashboard's /api/timeline JSON) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cells = timeline.get("cells", [])
    bands = timeline.get("bands", {})
    series = timeline.get("series", {})
    fig, (ax_roles, ax_w, ax_v) = plt.subplots(
        3,
        1,
        figsize=(12, 2.0 + 0.45 * max(len(cells), 1) + 4.5),
        sharex=True,
        gridspec_kw={"height_ratios": [max(len(cells), 1) * 0.45 + 0.6, 2.5, 2.0]},
    )
    labels = []
    for row, cell in enumerate(reversed(cells)):
        for start, end, state in bands.get(cell["cell_id"], []):
            ax_roles.broken_barh(
                [(start, max(end - start, 0.05))], (row - 0.4, 0.8), color=ROLE_COLORS.get(state, "#eeeeee")
            )
        labels.append(f"{cell['cell_id']} ({cell.get('role', '')})")
    ax_roles.set_yticks(range(len(labels)), labels)
    ax_roles.set_title(title)
    used = sorted({b[2] for bs in bands.values() for b in bs if b[2] != "GONE"})
    ax_roles.legend(
        handles=[Patch(color=ROLE_COLORS[s], label=s.lower()) for s in used],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    t = series.get("t", [])
    if t:
        ax_w.step(
            t,
            series.get("waterlevel", []),
            where="post",
            label="waterlevel W",
            color="#d64545",
            linewidth=1.8,
        )
        ax_w.step(
            t,
            series.get("capacity", []),
            where="post",
            label="rollout capacity",
            color="#1f2933",
            linestyle="--",
        )
        ax_w.step(
            t,
            series.get("ready_groups", []),
            where="post",
            label="ready groups",
            color="#2e9d57",
            linestyle=":",
        )
    for mark_t, version in timeline.get("policy_marks", []):
        for ax in (ax_roles, ax_w):
            ax.axvline(mark_t, color="#888888", linewidth=0.6, linestyle="-.")
        ax_w.annotate(
            f"v{version}", (mark_t, 0), textcoords="offset points", xytext=(2, 2), fontsize=7, color="#555555"
        )
    ax_w.set_ylabel("executions / slots")
    ax_w.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax_w.grid(alpha=0.3)
    _plot_versions(ax_v, t, timeline.get("version_w", {}))
    ax_v.set_xlabel("seconds since start")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_versions(ax: Any, t: list[float], version_w: dict[str, list[int]]) -> None:
    """Open executions per policy version, stacked: two bands at once are overlapping bursts."""
    versions = sorted(version_w, key=int)
    if t and versions:
        ys = [version_w[v][: len(t)] for v in versions]
        ax.stackplot(t, ys, labels=[f"v{v}" for v in versions], step="post", alpha=0.85)
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
            ncol=1 + len(versions) // 12,
            title="burst version",
            title_fontsize=7,
        )
    ax.set_ylabel("open executions\nby version")
    ax.grid(alpha=0.3)
