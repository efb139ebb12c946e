"""The demo ends when its work is done, however the scheduler's policy grouped it into
bursts: the asynchronous policies may dispatch several bursts' worth of tasks at once (with
``--bursts 2``, all 40 executions in burst 1), and the run used to wait for a second burst
that never came, until its timeout."""

from __future__ import annotations

from apps.demo.runner import _all_done, planned_executions

SECTION = {"batch_size": 4, "group_size": 4, "over_provision": 0.25, "batches_per_burst": 1, "max_bursts": 2}


def _status(bursts: int, dispatched: int, finished: int, waterlevel: int = 0) -> dict:
    return {
        "bursts_completed": bursts,
        "ledger": {"waterlevel": waterlevel},
        "total": {"dispatched": dispatched, "finished": finished},
    }


def test_planned_executions_is_max_bursts_worth_of_groups():
    assert planned_executions(SECTION) == 40
    assert planned_executions({**SECTION, "max_bursts": 0}) == 0  # unbounded


def test_all_tasks_dispatched_in_one_burst_and_finished_ends_the_run():
    assert _all_done(_status(1, 40, 40), bursts=2, planned=40)


def test_not_done_while_work_remains():
    assert not _all_done(_status(1, 40, 39), bursts=2, planned=40)
    assert not _all_done(_status(1, 20, 20), bursts=2, planned=40)
    assert not _all_done(_status(2, 40, 38, waterlevel=2), bursts=2, planned=40)
    assert not _all_done(_status(1, 40, 40), bursts=2, planned=0)


def test_not_done_before_the_first_update():
    """Every task finished, but nothing trained yet (the fault test with the core SIGKILLed
    ended here under load: 40/40 finished, 0 versions published)."""
    assert not _all_done(_status(0, 40, 40), bursts=2, planned=40)


def test_the_bursts_completed_still_end_it():
    assert _all_done(_status(2, 40, 40), bursts=2, planned=40)


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
