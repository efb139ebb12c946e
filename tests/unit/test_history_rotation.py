"""History rotation (gyre/history.py: ``history_max_bytes``, ``history_keep``): a history
split over rotated segments checks the same as one file, several writers of one file
(every cell appends to ``cell_agent.jsonl``) lose no line when one of them rotates it, and
retention that deleted the oldest segments is reported in the checker's verdict."""

from __future__ import annotations

import json
from pathlib import Path

from apps.checker import check_files
from apps.checker.__main__ import main
from gyre.config import load
from gyre.history import History, base, pruned, read, segments
from services.packer.config import PackerConfig
from testkit import packer_kit as tk


def _without_t(ops: list[dict]) -> list[dict]:
    return [{k: v for k, v in op.items() if k != "t"} for op in ops]


async def test_a_history_split_over_rotated_segments_checks_the_same_as_one_file(tmp_path: Path):
    one, split = tmp_path / "one" / "packer.jsonl", tmp_path / "split" / "packer.jsonl"
    one.parent.mkdir()
    split.parent.mkdir()
    await tk.history_run(History(str(one), svc="packer"))
    await tk.history_run(History(str(split), svc="packer", max_bytes=600))

    segs = segments(split)
    assert len(segs) >= 2 and [n for n, _ in segs] == list(range(1, len(segs) + 1))
    for _, seg in segs:  # each rotated before a line would have taken it past 600 bytes
        assert seg.stat().st_size <= 600
    assert _without_t(read(split)) == _without_t(read(one))  # every line, in order

    whole, rotated = check_files([one]), check_files([split])
    assert whole.ok and rotated.ok, rotated.violations
    assert rotated.to_json() == whole.to_json()
    assert rotated.counts["batches_committed"] == 1 and rotated.counts["finishes"] == 4
    # Naming a segment, or the history and its segments (a shell glob), reads it once.
    assert check_files([segs[0][1]]).to_json() == whole.to_json()
    assert check_files([split, *(p for _, p in segs)]).to_json() == whole.to_json()
    assert base(segs[0][1]) == split and base(split) == split


def test_writers_of_one_file_lose_no_line_when_one_rotates(tmp_path: Path):
    path = tmp_path / "cell_agent.jsonl"
    writers = [History(str(path), svc="cell", max_bytes=2000, cell=f"e{i}") for i in range(3)]
    for n in range(200):
        writers[n % 3].append("train", 0, ms=f"m{n}", pad="x" * (n % 40))
    for w in writers:
        w.close()
    ops = read(path)
    trained = [op["ms"] for op in ops if op["op"] == "train"]
    assert sorted(trained) == sorted(f"m{n}" for n in range(200))  # each line once
    assert sum(1 for op in ops if op["op"] == "start") == 3
    assert len(segments(path)) >= 5 and not pruned(path)
    for _, seg in segments(path):  # a writer may add a line to a segment another just rotated
        assert seg.stat().st_size <= 2000 + 2 * 200


async def test_retention_keeps_the_newest_segments_and_the_checker_says_so(tmp_path: Path, capsys):
    path = tmp_path / "packer.jsonl"
    await tk.history_run(History(str(path), svc="packer", max_bytes=600, keep=2))
    segs = segments(path)
    assert len(segs) == 2 and segs[0][0] > 1 and pruned(path)
    verdict = check_files([path])
    assert verdict.pruned == [str(path)]
    assert main([str(path)]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["pruned"] == [str(path)]


def test_retention_is_configured_like_any_setting(tmp_path: Path, monkeypatch):
    config = tmp_path / "cluster.yaml"
    config.write_text("cluster: {history_max_bytes: 1048576}\npacker: {history_keep: 4}\n")
    cfg = load(PackerConfig, config)
    assert (cfg.history_max_bytes, cfg.history_keep) == (1048576, 4)
    monkeypatch.setenv("GYRE_PACKER__HISTORY_KEEP", "0")
    assert load(PackerConfig, config).history_keep == 0
    assert PackerConfig().history_keep == 0  # the default keeps every segment: a run stays checkable
