"""The demo ends when its work is done, however the scheduler's policy grouped it into
bursts: the asynchronous policies may dispatch several bursts' worth of tasks at once (with
``--bursts 2``, all 40 executions in burst 1), and the run used to wait for a second burst
that never came, until its timeout."""

from __future__ import annotations

import pytest

from apps.demo.runner import RunEnd, planned_executions

SECTION = {"batch_size": 4, "group_size": 4, "over_provision": 0.25, "batches_per_burst": 1, "max_bursts": 2}


def _status(
    bursts: int,
    dispatched: int,
    finished: int,
    waterlevel: int = 0,
    burst_id: int = 1,
    ready_groups: int = 0,
    version: int | None = None,
) -> dict:
    return {
        "bursts_completed": bursts,
        "policy_version": bursts if version is None else version,
        "ready_groups": ready_groups,
        "batch_size": 4,
        "ledger": {"waterlevel": waterlevel, "burst_id": burst_id},
        "total": {"dispatched": dispatched, "finished": finished},
    }


def _done(status: dict, planned: int = 40, now_s: float = 0.0, end: RunEnd | None = None) -> bool:
    return (end or RunEnd(bursts=2, planned=planned)).done(status, now_s)


def test_planned_executions_is_max_bursts_worth_of_groups():
    assert planned_executions(SECTION) == 40
    assert planned_executions({**SECTION, "max_bursts": 0}) == 0  # unbounded


def test_all_tasks_dispatched_in_one_burst_and_finished_ends_the_run():
    assert _done(_status(1, 40, 40, burst_id=1))


def test_not_done_while_work_remains():
    assert not _done(_status(1, 40, 39))
    assert not _done(_status(1, 20, 20))
    assert not _done(_status(2, 40, 38, waterlevel=2))
    assert not _done(_status(1, 40, 40), planned=0)


def test_not_done_before_the_first_update():
    """Every task finished, but nothing trained yet (the fault test with the core SIGKILLed
    ended here under load: 40/40 finished, 0 versions published)."""
    assert not _done(_status(0, 40, 40))


def test_the_bursts_completed_still_end_it():
    assert _done(_status(2, 40, 40, burst_id=2))
    assert _done(_status(2, 40, 40, burst_id=2), planned=0)  # unbounded supply: bursts alone


def test_the_bursts_completed_do_not_end_it_while_dispatched_work_remains():
    """A demo at eta = 1 dispatched 24 small bursts; 15 completed while 25 of the 300
    executions had not launched yet, and the run ended with them counted as lost."""
    assert not _done(_status(2, 40, 35, burst_id=3))
    assert not _done(_status(2, 30, 30, burst_id=3))  # the supply is not all dispatched yet


def test_not_done_while_the_last_bursts_batch_trains():
    """The burst-synchronous policy dispatched 2 bursts of 20; all 40 finished, burst 1 is
    trained, burst 2's batch is ready or training. CI ended the run here ('1 version
    published of 2') before the fix."""
    end = RunEnd(bursts=2, planned=40, settle_s=30)
    assert not end.done(_status(1, 40, 40, burst_id=2, ready_groups=5), 0.0)  # a batch to cut
    assert not end.done(_status(1, 40, 40, burst_id=2, ready_groups=1), 1.0)  # cut, training
    assert not end.done(_status(1, 40, 40, burst_id=2, ready_groups=1), 20.0)
    assert end.done(_status(2, 40, 40, burst_id=2, ready_groups=1), 25.0)  # published


def test_a_last_burst_that_cannot_complete_ends_the_run_once_training_settles():
    """An asynchronous policy's last burst may aim at a version its leftover data cannot
    reach: the run ends when no batch is left and the version held still for settle_s."""
    end = RunEnd(bursts=15, planned=40, settle_s=30)
    assert not end.done(_status(2, 40, 40, burst_id=3, ready_groups=1), 0.0)
    assert not end.done(_status(2, 40, 40, burst_id=3, ready_groups=1), 29.0)
    assert end.done(_status(2, 40, 40, burst_id=3, ready_groups=1), 30.0)
    assert not end.done(_status(3, 40, 40, burst_id=4, ready_groups=1, version=3), 31.0)  # moved


def test_vllm_cells_get_a_long_ready_wait_and_every_service_a_history(tmp_path):
    import yaml

    from apps.demo.runner import HISTORIES, VLLM_READY_TIMEOUT_S, DemoOptions, render_config

    for engine in ("vllm", "mock"):
        opts = DemoOptions(engine=engine, run_dir=tmp_path / engine, dashboard_port=0)
        data = yaml.safe_load(render_config(opts, tmp_path / "model").read_text())
        cells = [p for p in data["launch"]["processes"] if p["service"] == "cell_agent"]
        assert cells
        waits = {p.get("ready_timeout_s") for p in cells}
        assert waits == ({VLLM_READY_TIMEOUT_S} if engine == "vllm" else {None})
        assert all(data[s]["history_file"].endswith(f"history/{s}.jsonl") for s in HISTORIES)
        assert "cell_agent" in HISTORIES


def test_the_run_records_the_commit_it_started_at(tmp_path, monkeypatch):
    """summary.json's commit is the checkout's when the run starts: three runs in a row
    during which docs were committed all said the last commit, which none of them ran."""
    import asyncio

    from apps.demo import runner

    calls: list[str] = []

    class Started(Exception):
        pass

    def model(console):
        calls.append("model")
        raise Started

    monkeypatch.setattr(runner, "checkout_commit", lambda: calls.append("commit") or "abc1234")
    monkeypatch.setattr(runner, "build_model", model)
    with pytest.raises(Started):
        asyncio.run(runner.run_demo(runner.DemoOptions(run_dir=tmp_path, dashboard_port=0)))
    assert calls == ["commit", "model"]
