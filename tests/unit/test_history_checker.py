"""The offline history checker (apps/checker): a good history passes, and each violation of
docs/reliability.md's promises, put by hand into a history, is detected. The packer's history
(services/packer/history.py) written by a real packer through a crash-free run and a reopened
attempt checks clean."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from apps.checker import check, check_files
from apps.checker.__main__ import main
from gyre.history import History, read
from services.packer.packer import LATE_TURN
from testkit import packer_kit as tk


def _p(op: str, **f: Any) -> dict[str, Any]:
    return {"op": op, "t": 0, "epoch": 0, "svc": "packer", **f}


def _s(op: str, **f: Any) -> dict[str, Any]:
    return {"op": op, "t": 0, "epoch": 1, **f}


def good() -> list[dict[str, Any]]:
    """One burst of two executions (one group), one batch of two micro-steps, trained once
    through a reopened attempt (a core crash before its step)."""
    return [
        _s("leader", rev=1, epoch=1),
        _s("dispatch", rev=2, burst_id=1, quota=2),
        _s("launch", rev=3, execution_id="b1-e0", burst_id=1),
        _s("launch", rev=4, execution_id="b1-e1", burst_id=1),
        _s("close", rev=5, execution_id="b1-e0", status="COMPLETED"),
        _s("close", rev=6, execution_id="b1-e1", status="COMPLETED"),
        _p("start", pid=1),
        _p("finish", execution_id="b1-e0", group_id="g1", status="COMPLETED"),
        _p("finish", execution_id="b1-e1", group_id="g1", status="COMPLETED"),
        _p("assign", b=1, g="g1"),
        _p("emit", ms="m0", b=1, executions=["b1-e0"]),
        _p("emit", ms="m1", b=1, executions=["b1-e1"]),
        _p("seal", b=1),
        _p("open", b=1, cell="core"),
        _p("activate", b=1, v=0),
        _p("claim", ms="m0", cell="core", v=0),
        _p("claim", ms="m1", cell="sat", v=0),
        _p("ack", ms="m0", cell="core"),
        _p("open", b=1, cell="core"),  # the core crashed: a new attempt, acks return
        _p("claim", ms="m0", cell="core", v=0),
        _p("claim", ms="m1", cell="core", v=0),
        _p("ack", ms="m0", cell="core"),
        _p("ack", ms="m1", cell="core"),
        _p("commit", b=1, cell="core"),
    ]


def test_a_good_history_passes_with_counts():
    v = check(good(), complete=True)
    assert v.ok, v.violations
    assert v.counts["executions_dispatched"] == 2 and v.counts["executions_closed"] == 2
    assert (
        v.counts["batches_committed"] == 1
        and v.counts["groups_trained"] == 1
        and v.counts["micro_steps"] == 2
    )


def _mutate(ops: list[dict[str, Any]], where: int, new: dict[str, Any] | None = None, delete: bool = False):
    ops = list(ops)
    if delete:
        del ops[where]
    else:
        assert new is not None
        ops.insert(where, new)
    return ops


def _index(ops: list[dict[str, Any]], **match: Any) -> int:
    return next(i for i, op in enumerate(ops) if all(op.get(k) == v for k, v in match.items()))


BAD = {
    "closed twice": lambda h: _mutate(h, 6, _s("close", rev=7, execution_id="b1-e1", status="FAILED")),
    "never closed": lambda h: _mutate(h, _index(h, op="close", execution_id="b1-e1"), delete=True),
    "finish .* accepted twice": lambda h: _mutate(
        h, 9, _p("finish", execution_id="b1-e0", group_id="g1", status="COMPLETED")
    ),
    "trained twice": lambda h: h + [_p("assign", b=2, g="g1")],
    "committed 2 times": lambda h: h + [_p("commit", b=1, cell="core")],
    "micro-steps lost": lambda h: _mutate(h, len(h) - 2, delete=True),  # the last ack of m1
    "mixed weight versions": lambda h: _mixed(h),
    "claimed again after its acknowledgement": lambda h: _mutate(
        h, len(h) - 1, _p("claim", ms="m0", cell="sat", v=0)
    ),
    "acknowledged twice in one attempt": lambda h: _mutate(h, len(h) - 1, _p("ack", ms="m1", cell="core")),
    "never reported to the packer": lambda h: _mutate(
        h, _index(h, op="finish", execution_id="b1-e1"), delete=True
    ),
    "never closed by the scheduler": lambda h: (
        h + [_p("finish", execution_id="b9-e0", group_id="g9", status="COMPLETED")]
    ),
    "dropped \\(turn buffer full\\)": lambda h: (
        h
        + [
            {
                "op": "turn_dropped",
                "t": 0,
                "epoch": 0,
                "svc": "router",
                "execution_id": "b1-e0",
                "turn_index": 3,
            }
        ]
    ),
    "refused as late, and its group g1 was trained without it": lambda h: h + [_late_turn("b1-e0")],
    "reopened after its commit": lambda h: h + [_p("open", b=1, cell="core")],
    "after epoch 2 was elected": lambda h: _mutate(h, 6, _s("leader", rev=6, epoch=2)),
}


def _late_turn(execution_id: str) -> dict[str, Any]:
    """The router's record of a turn the packer refused because its group was complete."""
    return {
        "op": "turn_refused",
        "t": 0,
        "epoch": 0,
        "svc": "router",
        "execution_id": execution_id,
        "turn_index": 2,
        "error": f"group g1 is already complete; turn 2 of {execution_id} {LATE_TURN}",
    }


def test_a_late_turn_of_a_dropped_group_or_another_refusal_is_no_loss():
    h = good()
    dropped = [op for op in h if op.get("op") not in ("assign", "emit")] + [_p("drop", g="g1", reason="x")]
    dropped = [
        op for op in dropped if op.get("op") not in ("seal", "open", "activate", "claim", "ack", "commit")
    ]
    v = check(dropped + [_late_turn("b1-e0")], complete=True)
    assert not any("refused as late" in m for m in v.violations), v.violations
    other = {**_late_turn("b1-e0"), "error": "turn of 9000 tokens is over the budget of 8192"}
    v = check(h + [other], complete=True)
    assert v.ok, v.violations
    assert v.counts["turns_refused"] == 1


def _mixed(h: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The second attempt's claims on two weight versions (the batch activated on none)."""
    out = [op for op in h if op.get("op") != "activate"]
    last = max(i for i, op in enumerate(out) if op.get("op") == "claim")
    out[last] = {**out[last], "v": 1}
    return out


@pytest.mark.parametrize("what", sorted(BAD))
def test_each_violation_is_detected(what: str):
    v = check(BAD[what](good()), complete=True)
    assert not v.ok
    assert any(re.search(what, msg) for msg in v.violations), v.violations


def test_a_claim_on_another_version_than_the_batch_is_detected():
    h = good()
    i = _index(h, op="claim", ms="m1", cell="sat")
    h[i] = {**h[i], "v": 3}
    assert any("its batch trains on v0" in m for m in check(h).violations)


def test_missing_context_is_unknown_not_a_violation():
    """A packer killed between its WAL fsync and its history write loses an emit line: the
    claims and acks of that micro-step are then not judged."""
    h = [op for op in good() if not (op.get("op") == "emit" and op.get("ms") == "m1")]
    assert check(h).ok


def _lost_line(h: list[dict[str, Any]], op: str, **match: Any) -> list[dict[str, Any]]:
    """The history of a leader killed after its ``op`` write landed, before its line: the
    invoke it wrote first stays in the line's place."""
    out = []
    for o in h:
        if o.get("op") == op and all(o.get(k) == v for k, v in match.items()):
            o = {**{k: v for k, v in o.items() if k not in ("rev", "status")}, "op": "invoke", "of": op}
        out.append(o)
    return out


@pytest.mark.parametrize(
    ("op", "match"),
    [
        ("launch", {"execution_id": "b1-e1"}),
        ("dispatch", {"burst_id": 1}),
        ("close", {"execution_id": "b1-e1"}),
    ],
)
def test_a_write_whose_line_a_kill_took_is_indeterminate(op: str, match: dict[str, Any]):
    """A leader killed between a write and its history line leaves the invoke it wrote first:
    the operation took effect if a later one shows it did (a close of that launch, a launch in
    that burst, the close's finish at the packer). Without the invoke, the history fails: the
    case the failover test met (``b1-t5-1 closed without a launch``)."""
    h = _lost_line(good(), op, **match)
    assert check(h, complete=True).ok, check(h, complete=True).violations
    gone = [o for o in h if o.get("op") != "invoke"]
    assert not check(gone, complete=True).ok


def test_an_indeterminate_close_never_reported_is_lost():
    """An indeterminate close the packer never heard of: either it did not happen (the
    execution was never closed) or its report was lost; both break the complete run."""
    h = [
        o
        for o in _lost_line(good(), "close", execution_id="b1-e1")
        if o.get("execution_id") != "b1-e1" or o.get("svc") != "packer"
    ]
    v = check(h, complete=True).violations
    assert any("b1-e1 closed by the scheduler, never reported" in x for x in v), v


def test_a_launch_invoked_and_not_landed_is_no_launch():
    """An invoke followed by a successor's real launch of the same execution is one launch."""
    h = good()
    h.insert(2, {**_s("invoke", execution_id="b1-e0", burst_id=1), "of": "launch"})
    assert check(h, complete=True).ok


def test_incomplete_runs_are_judged_only_on_what_happened():
    h = good()[:5]  # executions launched, one closed; no packer yet
    assert check(h).ok
    assert not check(h, complete=True).ok


def test_files_and_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    sched, pack = tmp_path / "scheduler.jsonl", tmp_path / "packer.jsonl"
    ops = good()
    sched.write_text("".join(json.dumps(op) + "\n" for op in ops if "svc" not in op))
    pack.write_text(
        "".join(json.dumps(op) + "\n" for op in ops if "svc" in op) + '{"op": "ack", "ms"'
    )  # torn last line
    assert check_files([sched, pack], complete=True).ok
    assert main(["--complete", str(sched), str(pack)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    pack.write_text(pack.read_text() + "\n" + json.dumps(_p("commit", b=1, cell="core")) + "\n")
    assert main([str(sched), str(pack)]) == 1


async def test_a_real_packers_history_checks_clean(tmp_path: Path):
    path = tmp_path / "packer.jsonl"
    await tk.history_run(History(str(path), svc="packer"), commits=2)  # a retried commit
    ops = read(path)
    kinds = {op["op"] for op in ops}
    assert {"start", "finish", "assign", "emit", "claim", "ack", "open", "commit", "activate"} <= kinds
    v = check(ops)
    assert v.ok, v.violations
    assert (
        v.counts["batches_committed"] == 1 and v.counts["groups_trained"] == 2 and v.counts["finishes"] == 4
    )
    # The same history with the second attempt's last ack dropped: a micro-step lost.
    last_ack = max(i for i, op in enumerate(ops) if op["op"] == "ack")
    assert not check(ops[:last_ack] + ops[last_ack + 1 :]).ok


def _c(op: str, t: float, cell: str = "e0", **f: Any) -> dict[str, Any]:
    return {"op": op, "t": t, "epoch": f.pop("epoch", 0), "svc": "cell", "cell": cell, **f}


def cells_good() -> list[dict[str, Any]]:
    """Two elastic cells through rollout, one batch (core e0 + satellite e1, a reopened
    attempt after a broken collective), and back to rollout on the new version."""
    ops = [_c("start", 0, pid=1), _c("start", 0, "e1", pid=2)]
    for cell in ("e0", "e1"):
        ops += [
            _c("state", 1, cell, frm="STARTING", to="ROLLOUT", v=0),
            _c("state", 2, cell, frm="ROLLOUT", to="DRAINING", v=0, epoch=5),
            _c("state", 3, cell, frm="DRAINING", to="TRAINING", v=0, epoch=5),
        ]
    ops += [
        _c("join", 4, b=1, v=0, index=0),
        _c("join", 4.1, "e1", b=1, v=0, index=1),
        _c("train", 5, b=1, ms="m0", v=0),
        _c("ack", 5.1, b=1, ms="m0", claimed=4.5),
        _c("join", 6, b=1, v=0, index=0),  # a second attempt: m0 is handed out again
        _c("ack", 6.05, "e1", b=1, ms="m1", claimed=5.5),  # claimed before it: the old attempt
        _c("train", 7, "e1", b=1, ms="m0", v=0),
        _c("ack", 7.1, "e1", b=1, ms="m0", claimed=6.5),
        _c("train", 7.2, b=1, ms="m1", v=0),
        _c("ack", 7.3, b=1, ms="m1", claimed=6.6),
        _c("step", 8, b=1, v=0, new_v=1, applied=True),
        _c("commit", 8.1, b=1),
        _c("publish", 8.2, b=1, v=1),
    ]
    for cell in ("e0", "e1"):
        ops += [
            _c("state", 9, cell, frm="TRAINING", to="RETURNING", v=0, epoch=6),
            _c("load", 10, cell, prev=0, v=1, t0=9.5, epoch=6),
            _c("state", 11, cell, frm="RETURNING", to="ROLLOUT", v=1, epoch=6),
        ]
    return ops


def test_a_good_cell_history_passes_with_counts():
    v = check(cells_good())
    assert v.ok, v.violations
    assert v.counts["optimizer_steps"] == 1 and v.counts["micro_steps_trained"] == 3
    assert v.counts["cell_loads"] == 2 and v.counts["cell_role_changes"] == 10


CELL_BAD = {
    "not in the lifecycle table": lambda h: h + [_c("state", 12, frm="ROLLOUT", to="TRAINING", epoch=6)],
    "while it was": lambda h: h + [_c("state", 12, frm="TRAINING", to="RETURNING", epoch=6)],
    "a deposed leader": lambda h: h + [_c("state", 12, frm="ROLLOUT", to="DRAINING", epoch=5)],
    "two versions at once": lambda h: h + [_c("load", 12, prev=1, v=2, t0=9.8, epoch=6)],
    "went back": lambda h: h + [_c("load", 13, prev=1, v=0, t0=12, epoch=6)],
    "mixed weight versions": lambda h: h + [_c("train", 7.5, "e1", b=1, ms="m2", v=1)],
    "acknowledged twice in one attempt": lambda h: h + [_c("ack", 7.4, "e1", b=1, ms="m1", claimed=7)],
    "stepped twice": lambda h: h + [_c("step", 8.5, b=1, v=0, new_v=2, applied=True)],
    "stepped to v1 after v1": lambda h: h + [_c("step", 8.5, b=2, v=0, new_v=1, applied=True)],
}


@pytest.mark.parametrize("what", sorted(CELL_BAD))
def test_each_cell_violation_is_detected(what: str):
    v = check(CELL_BAD[what](cells_good()))
    assert not v.ok
    assert any(re.search(what, msg) for msg in v.violations), v.violations


def test_a_restarted_cell_starts_a_new_incarnation():
    h = cells_good() + [
        _c("start", 12, pid=3),
        _c("state", 13, frm="STARTING", to="ROLLOUT", v=0),  # back on v0, epoch floor gone
        _c("load", 14, prev=0, v=1, t0=13.5, epoch=2),
    ]
    assert check(h).ok, check(h).violations


def test_a_cell_ack_the_packer_never_recorded_is_lost():
    packer = [_p("ack", ms=ms, cell=cell) for ms, cell in (("m0", "e0"), ("m1", "e1"), ("m0", "e1"))]
    assert not check(cells_good() + packer).ok  # e0's ack of m1 is not there
    packer.append(_p("ack", ms="m1", cell="e0"))
    assert check(cells_good() + packer).ok, check(cells_good() + packer).violations
    v = check(cells_good() + packer[1:])
    assert any("acknowledged, then lost" in m for m in v.violations)


def test_an_indeterminate_close_counts_as_a_close_in_a_complete_run():
    """The count agrees with the checker's own cross check: a close whose line a killed
    leader never wrote took effect when its successor relayed it (the chaos demo's CI
    failure: ``executions_closed`` 39 of 40 with a clean verdict)."""
    h = _lost_line(good(), "close", execution_id="b1-e1")
    assert check(h, complete=True).counts["executions_closed"] == 2
    assert check(h).counts["executions_closed"] == 1  # not complete: it may not have happened


async def test_a_finish_whose_line_a_kill_took_is_seen_when_its_report_is_retried(tmp_path: Path):
    """The packer made a finish report durable and was killed before writing its history line
    (a failpoint in a concurrent claim; CI: `packer.claim.granted`). The restarted packer
    answers the scheduler's retry as a duplicate, and its history must show that the report
    reached it, or the cross check calls the execution lost."""
    from apps.checker import check_cross
    from services.packer.history import HistoryLog

    p, log, _ = tk.make_packer()
    await p.report_finish(tk.finish("x0", "g0", 2))  # durable; its history line never written
    path = tmp_path / "packer.jsonl"
    history = History(str(path), svc="packer")
    p.log = HistoryLog(log, history)  # the restarted packer's history
    assert await p.report_finish(tk.finish("x0", "g0", 2))  # the scheduler's retry: a duplicate
    history.close()
    sched = [
        _s("dispatch", burst_id=1, quota=1),
        _s("launch", execution_id="x0"),
        _s("close", execution_id="x0"),
    ]
    assert check_cross(sched, read(path)) == []
