"""The training diagnostics of the policy record (``keys.policy()``'s ``training``, written
by the core with each version) reach the scheduler's status and GetStatus.

Invariants: the status carries the newest record's diagnostics with that record's version;
a record without ``training`` (mock trainers, older records) leaves the status without any,
also when it replaces one that had them; an older record changes nothing; a new leader
reads them from the stored record; GetStatus leaves the message unset when there are none,
and the dashboard's conversion of the answer keeps every value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gyre.v1 import scheduler_pb2
from services.dashboard.source import status_to_dict
from services.dashboard.timeline import normalize_status
from services.scheduler.servicer import ControlServicer
from services.scheduler.status import TrainingDiagnostics
from testkit.dashboard_status import DIAG
from testkit.scheduler_rig import KV, lead, make


def record(version: int, training: dict[str, Any] | None = None) -> dict[bytes, KV]:
    body: dict[str, Any] = {"version": version, "source_target": "core:1", "batch_id": version}
    if training is not None:
        body["training"] = training
    return {b"p": KV(b"p", json.dumps(body).encode())}


async def test_status_carries_the_newest_records_diagnostics() -> None:
    s, store, _, _ = make(policy="rollout_only")
    await lead(s, store)
    assert s.status().training is None
    s.on_policy(record(1, DIAG))
    t = s.status().training
    assert t is not None and t.policy_version == 1
    assert t.clip_fraction == 0.125 and t.grad_norm == 0.8 and t.tokens == 1536.0
    assert t.lag_hist == tuple(DIAG["lag_hist"]) and t.lag_mean == 0.435
    s.on_policy(record(2, {**DIAG, "clip_fraction": 0.25}))
    t = s.status().training
    assert t is not None and (t.policy_version, t.clip_fraction) == (2, 0.25)
    s.on_policy(record(1, {**DIAG, "clip_fraction": 0.5}))  # an older record: nothing changes
    assert s.status().training == t


async def test_a_record_without_training_leaves_the_status_empty() -> None:
    s, store, _, _ = make(policy="rollout_only")
    await lead(s, store)
    s.on_policy(record(1))
    assert s.status().policy_version == 1 and s.status().training is None
    s.on_policy(record(2, DIAG))
    assert s.status().training is not None
    s.on_policy(record(3))  # the newest record has none: no stale diagnostics shown as new
    assert s.status().policy_version == 3 and s.status().training is None
    s.on_policy(record(4, {}))
    assert s.status().training is None


def test_malformed_training_values_read_as_zero_and_non_finite_are_kept() -> None:
    assert TrainingDiagnostics.from_record(3, "x") is None
    assert TrainingDiagnostics.from_record(3, [1, 2]) is None
    t = TrainingDiagnostics.from_record(
        3, {"clip_fraction": "bad", "entropy": True, "grad_norm": float("nan"), "lag_hist": "x"}
    )
    assert t is not None and t.policy_version == 3
    assert t.clip_fraction == 0.0 and t.entropy == 0.0 and t.tokens == 0.0 and t.lag_hist == ()
    assert math.isnan(t.grad_norm)


async def test_new_leader_reads_the_diagnostics_of_the_stored_record() -> None:
    s, store, _, _ = make(policy="rollout_only")
    store.policy = {"version": 5, "source_target": "core:1", "batch_id": 5, "training": DIAG}
    await lead(s, store)
    t = s.status().training
    assert t is not None and t.policy_version == 5 and t.entropy == 1.75


async def test_get_status_sets_the_message_only_with_diagnostics() -> None:
    s, store, _, _ = make(policy="rollout_only")
    await lead(s, store)
    servicer = ControlServicer(s)
    s.on_policy(record(1))
    answer = await servicer.GetStatus(scheduler_pb2.GetStatusRequest(), None)
    assert not answer.HasField("training")
    assert "training" not in status_to_dict(answer)
    assert normalize_status(status_to_dict(answer))["training"] is None

    s.on_policy(record(2, DIAG))
    answer = await servicer.GetStatus(scheduler_pb2.GetStatusRequest(), None)
    assert answer.HasField("training") and answer.training.policy_version == 2
    assert list(answer.training.lag_hist) == DIAG["lag_hist"]
    got = normalize_status(status_to_dict(answer))["training"]
    assert got == {"policy_version": 2, **DIAG}
