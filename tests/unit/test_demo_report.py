"""The README's current result is generated from the runs' summaries: one row per run, and
a verdict that says how many runs learned and whether the cells moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.demo.report import BEGIN, END, main


def _summary(first: tuple[float, float, float], last: tuple[float, float, float], back: int = 0) -> dict:
    def ev(v: int, m: tuple[float, float, float]) -> dict:
        return {"version": v, "mean": m[0], "ci95": [m[1], m[2]], "n": 128}

    return {
        "outcome": "completed",
        "engine": "vllm",
        "wall_s": 441.2,
        "started": "2026-12-06 09:25 UTC",
        "commit": "abc1234",
        "executions": {"dispatched": 300, "finished": 300, "lost": 0},
        "checker": {"ok": True},
        "transitions_to_training": 1,
        "transitions_to_rollout": back,
        "satellite_joins": 0,
        "eval": {"tasks": 32, "samples_per_task": 4, "first": ev(0, first), "last": ev(11, last)},
    }


def _runs(tmp_path: Path, summaries: list[dict]) -> list[str]:
    out = []
    for i, s in enumerate(summaries):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(s))
        out.append(str(d))
    return out


def test_the_readme_block_is_replaced_with_a_row_per_run(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nRESULT_PLACEHOLDER\n\nmore\n")
    learned = _summary((0.33, 0.25, 0.41), (0.91, 0.85, 0.96))
    overlap = _summary((0.33, 0.25, 0.41), (0.45, 0.38, 0.52), back=3)
    main([*_runs(tmp_path, [learned, overlap]), "--readme", str(readme)])
    body = readme.read_text()
    assert body.startswith("# x\n\n" + BEGIN) and body.endswith(END + "\n\nmore\n")
    assert "| v0 0.33 [0.25, 0.41] | v11 0.91 [0.85, 0.96] | yes |" in body
    assert "| v11 0.45 [0.38, 0.52] | no |" in body
    assert "in 1 of 2 runs" in body and "moved to training 2 times and back 3 times" in body
    assert (
        "0 of 2 runs moved cells at least 3 times each way, 0 of 2 at least 3 times each way with at least 2 joins"
        in body
    )
    # A second run replaces the block, not the text around it.
    (tmp_path / "again").mkdir()
    main([*_runs(tmp_path / "again", [learned]), "--readme", str(readme)])
    body = readme.read_text()
    assert (
        body.count(BEGIN) == 1
        and "in 1 of 1 runs" in body
        and "No cell returned to rollout in any run, and no satellite joined a batch." in body
    )
    # The bar of issue 33: >= 3 moves each way and >= 2 satellite joins in a run.
    moving = {**_summary((0.33, 0.25, 0.41), (0.91, 0.85, 0.96), back=4), "transitions_to_training": 5}
    (tmp_path / "moving").mkdir()
    main([*_runs(tmp_path / "moving", [{**moving, "satellite_joins": 2}]), "--readme", str(readme)])
    assert "1 of 1 runs moved cells at least 3 times each way, 1 of 1 at least" in readme.read_text()
    # Without joins the moves each way are still counted.
    (tmp_path / "no-joins").mkdir()
    main([*_runs(tmp_path / "no-joins", [moving]), "--readme", str(readme)])
    assert "1 of 1 runs moved cells at least 3 times each way, 0 of 1 at least" in readme.read_text()


def test_a_readme_without_a_block_is_an_error(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    with pytest.raises(SystemExit):
        main([*_runs(tmp_path, [_summary((0.3, 0.2, 0.4), (0.9, 0.8, 1.0))]), "--readme", str(readme)])
