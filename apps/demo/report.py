"""The demo's result as people read it: one line per run from its ``summary.json``, and the
README's "current result" block written from the newest runs (``--readme``), so the figure
the README shows is always one a run produced, with its date, commit and configuration.

    python -m apps.demo.report runs/demo-A runs/demo-B runs/demo-C --readme README.md --readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from apps.docblock import replace_block

BEGIN = "<!-- demo result (python -m apps.demo.report): begin -->"
END = "<!-- demo result: end -->"


def load(run_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary.setdefault("run", run_dir.name)
    return summary


def _ev(e: dict[str, Any]) -> str:
    lo, hi = e["ci95"]
    return f"v{e['version']} {e['mean']:.2f} [{lo:.2f}, {hi:.2f}]"


def row(s: dict[str, Any]) -> str:
    """One markdown table row of a run."""
    ex, ev = s["executions"], s.get("eval") or {}
    first, last = ev.get("first"), ev.get("last")
    apart = "yes" if first and last and last["ci95"][0] > first["ci95"][1] else "no"
    return (
        f"| {s.get('started', s['run'])} | {s.get('commit', '?')} | {s['outcome']} "
        f"| {_ev(first) if first else '-'} | {_ev(last) if last else '-'} | {apart} "
        f"| {ex['dispatched']} / {ex['finished']} / {ex['lost']} "
        f"| {'ok' if s['checker']['ok'] else 'violations'} "
        f"| {s.get('transitions_to_training', 0)} / {s.get('transitions_to_rollout', 0)} "
        f"/ {s.get('satellite_joins', 0)} | {s['wall_s']:.0f} s |"
    )


def block(summaries: list[dict[str, Any]]) -> str:
    """The README block: what was run, a row per run, and the plain verdict."""
    n = len(summaries)
    learned = sum(
        1
        for s in summaries
        if (e := s.get("eval"))
        and e.get("first")
        and e.get("last")
        and e["last"]["ci95"][0] > e["first"]["ci95"][1]
    )
    engines = sorted({s["engine"] for s in summaries})
    ev: dict[str, Any] = next((s["eval"] for s in summaries if s.get("eval")), {})
    lines = [
        BEGIN,
        f"**Current result** ({n} `make demo` runs in a row with the defaults, {', '.join(engines)} engines, "
        f"2 CPU cores; held-out eval on {ev.get('tasks', '?')} tasks × {ev.get('samples_per_task', '?')} "
        "episodes, mean reward [95% bootstrap CI]):",
        "",
        "| run | commit | outcome | eval at v0 | eval at the last version | intervals apart "
        "| executions dispatched / finished / lost | history checker "
        "| moves to training / to rollout / satellite joins | wall time |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(row(s) for s in summaries),
        "",
        f"The held-out reward rose with non-overlapping intervals in {learned} of {n} runs. "
        + _moves(summaries),
        END,
    ]
    return "\n".join(lines)


def _moves(summaries: list[dict[str, Any]]) -> str:
    """How the cells moved over the runs, against the bar of >= 3 moves each way and >= 2
    satellite joins per run."""
    n = len(summaries)
    moves = [
        (s.get("transitions_to_training", 0), s.get("transitions_to_rollout", 0), s.get("satellite_joins", 0))
        for s in summaries
    ]
    if not any(back or joins for _, back, joins in moves):
        return "No cell returned to rollout in any run, and no satellite joined a batch."
    each_way = sum(1 for to, back, _ in moves if to >= 3 and back >= 3)
    met = sum(1 for to, back, joins in moves if to >= 3 and back >= 3 and joins >= 2)
    return (
        f"Cells moved to training {sum(m[0] for m in moves)} times and back "
        f"{sum(m[1] for m in moves)} times over the runs, with {sum(m[2] for m in moves)} satellite "
        f"joins; {each_way} of {n} runs moved cells at least 3 times each way, "
        f"{met} of {n} at least 3 times each way with at least 2 joins."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with summary.json)")
    parser.add_argument(
        "--readme",
        type=Path,
        action="append",
        default=[],
        help="write the result block into this file (repeatable)",
    )
    parser.add_argument("--commit", help="the commit the runs ran (for summaries that do not record it)")
    args = parser.parse_args(argv)
    summaries = [load(r) for r in args.runs]
    if args.commit:
        for s in summaries:
            s.setdefault("commit", args.commit)
    text = block(summaries)
    print(text)
    for path in args.readme:
        replace_block(path, BEGIN, END, text, placeholder="RESULT_PLACEHOLDER")


if __name__ == "__main__":
    main()
