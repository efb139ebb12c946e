"""The dashboard's timeline: scheduler status snapshots folded into role bands and series.

Pure logic (no aiohttp, no gRPC): :func:`normalize_status` validates one SchedulerStatus-like
dict (the proto's field names; enums as names with or without their prefix, or numbers) and
:class:`Timeline` folds a sequence of them, stamped by the caller's clock, into

- one list of role bands per cell (``[t_start_s, t_end_s, state]``, consecutive equal states
  merged; a cell that disappears from the status gets a ``GONE`` band),
- series of the gauges (waterlevel W, capacity, ready groups, policy version, reroutes, ...),
- policy-version markers, the open work (W) per policy version the bursts serve (several
  at once while bursts overlap), and the latest counters,
- the training diagnostics per policy version (SchedulerStatus.training: the loss
  diagnostics the core publishes with each version; one entry per version, the newest
  ``max_training`` kept),

bounded to ``max_samples`` samples, plus the latest scheduler events (decisions with their
reasons), deduplicated.  A status from a standby (``leader`` false, where the
scheduler reports it) or from a lower fencing epoch than one already seen (a deposed leader)
is ignored, so a dashboard that polls every replica never mixes two schedulers' views.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from gyre.diagnostics import MAX_LAG_BUCKETS, TRAINING_SCALARS
from gyre.etcd.values import CellKind, CellState

STATES = tuple(s.value for s in CellState)
"""Cell states as the dashboard names them (CellState's names: STARTING, ROLLOUT, ...)."""
GONE = "GONE"
"""The pseudo-state of a cell absent from the latest status (its registration lapsed)."""
UNKNOWN = "UNKNOWN"
KINDS = tuple(k.name for k in CellKind)

_STATE_BY_NUMBER = {0: UNKNOWN, **{int(s.to_proto()): s.value for s in CellState}}
_KIND_BY_NUMBER = {0: UNKNOWN, **{int(k.to_proto()): k.name for k in CellKind}}

LEDGER_FIELDS = ("burst_id", "dispatched", "launched", "finished", "queued", "running", "waterlevel")
STATUS_FIELDS = (
    "epoch",
    "capacity",
    "ready_groups",
    "batch_size",
    "policy_version",
    "reroutes",
    "bursts_completed",
    "transitions_to_training",
    "transitions_to_rollout",
    "open_bursts",
    "migrations",
)
SERIES_FIELDS = (
    "waterlevel",
    "capacity",
    "ready_groups",
    "batch_size",
    "policy_version",
    "reroutes",
    "dispatched",
    "finished",
    "running",
    "queued",
    "burst_id",
    "open_bursts",
)
VERSION_FIELDS = ("policy_version", "dispatched", "launched", "finished", "queued", "running", "waterlevel")
"""A per-version ledger (SchedulerStatus.versions): bursts overlap, each serving its version."""
MAX_VERSIONS = 64
MAX_TRAINING = 256


def _enum(value: Any, prefix: str, by_number: Mapping[int, str], allowed: tuple[str, ...]) -> str:
    if isinstance(value, bool):
        raise ValueError(f"bad enum value {value!r}")
    if isinstance(value, int):
        return by_number.get(value, UNKNOWN)
    if value is None or value == "":
        return UNKNOWN
    if not isinstance(value, str):
        raise ValueError(f"bad enum value {value!r}")
    name = value.upper()
    if name.startswith(prefix):
        name = name[len(prefix) :]
    if name == "UNSPECIFIED":
        return UNKNOWN
    if name not in allowed:
        raise ValueError(f"unknown {prefix.lower().rstrip('_')} {value!r}")
    return name


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key, 0)
    if value is None or value == "":
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{key}: not a number: {value!r}")
    return int(value)  # proto3 JSON renders int64 as strings


def _float(raw: Mapping[str, Any], key: str) -> float | None:
    """A double (missing: 0.0); None for NaN or an infinity, which plain JSON cannot carry
    (proto3 JSON renders them as the strings "NaN", "Infinity", "-Infinity")."""
    return _finite(key, raw.get(key, 0.0))


def _finite(key: str, value: Any) -> float | None:
    if value is None or value == "":
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{key}: not a number: {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{key}: not a number: {value!r}") from None
    return number if math.isfinite(number) else None


def _training(raw: Any) -> dict[str, Any] | None:
    """SchedulerStatus.training, or None when the status has none (absent or empty)."""
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return None
    if not isinstance(raw, Mapping):
        raise ValueError("training must be a mapping")
    hist = raw.get("lag_hist") or []
    if not isinstance(hist, list | tuple):
        raise ValueError("training.lag_hist must be a list")
    out: dict[str, Any] = {"policy_version": _int(raw, "policy_version")}
    out.update({k: _float(raw, k) for k in TRAINING_SCALARS})
    out["lag_hist"] = [_finite("training.lag_hist", x) for x in hist[:MAX_LAG_BUCKETS]]
    return out


def normalize_status(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A validated, canonical copy of a SchedulerStatus-like dict; ValueError if malformed.

    Missing numbers count as 0 (proto3 omits defaults); enums become bare names
    (``CELL_STATE_TRAINING``, ``TRAINING`` and ``4`` all become ``TRAINING``).
    """
    if not isinstance(raw, Mapping):
        raise ValueError("status must be a mapping")
    ledger_raw = raw.get("ledger") or {}
    if not isinstance(ledger_raw, Mapping):
        raise ValueError("ledger must be a mapping")
    ledger: dict[str, Any] = {k: _int(ledger_raw, k) for k in LEDGER_FIELDS}
    by_status = ledger_raw.get("finished_by_status") or {}
    if not isinstance(by_status, Mapping):
        raise ValueError("ledger.finished_by_status must be a mapping")
    ledger["finished_by_status"] = {str(k): _int(by_status, k) for k in by_status}
    cells_raw = raw.get("cells") or []
    if not isinstance(cells_raw, list | tuple):
        raise ValueError("cells must be a list")
    cells = []
    seen: set[str] = set()
    for c in cells_raw:
        if not isinstance(c, Mapping):
            raise ValueError("each cell must be a mapping")
        cell_id = c.get("cell_id")
        if not isinstance(cell_id, str) or not cell_id or len(cell_id) > 128:
            raise ValueError(f"bad cell_id {cell_id!r}")
        if cell_id in seen:
            raise ValueError(f"duplicate cell_id {cell_id!r}")
        seen.add(cell_id)
        cells.append(
            {
                "cell_id": cell_id,
                "kind": _enum(c.get("kind"), "CELL_KIND_", _KIND_BY_NUMBER, KINDS),
                "index": _int(c, "index"),
                "state": _enum(c.get("state"), "CELL_STATE_", _STATE_BY_NUMBER, STATES),
                "slots": _int(c, "slots"),
                "routed": _int(c, "routed"),
                "target": str(c.get("target") or ""),
                "policy_version": _int(c, "policy_version"),
            }
        )
    out: dict[str, Any] = {k: _int(raw, k) for k in STATUS_FIELDS}
    out["ledger"] = ledger
    out["cells"] = cells
    leader = raw.get("leader")
    if leader is not None and not isinstance(leader, bool):
        raise ValueError(f"leader must be a bool: {leader!r}")
    out["leader"] = leader  # None: the scheduler does not say
    out["policy"] = str(raw.get("policy") or "")[:64]
    total_raw = raw.get("total") or {}
    if not isinstance(total_raw, Mapping):
        raise ValueError("total must be a mapping")
    out["total"] = {k: _int(total_raw, k) for k in LEDGER_FIELDS if k != "burst_id"}
    out["versions"] = _versions(raw.get("versions") or [])
    out["training"] = _training(raw.get("training"))
    return out


def _versions(raw: Any) -> list[dict[str, int]]:
    """The per-version ledgers, by version (at most MAX_VERSIONS, the newest kept)."""
    if not isinstance(raw, list | tuple):
        raise ValueError("versions must be a list")
    out = []
    for v in raw:
        if not isinstance(v, Mapping):
            raise ValueError("each version ledger must be a mapping")
        out.append({k: _int(v, k) for k in VERSION_FIELDS})
    return sorted(out, key=lambda v: v["policy_version"])[-MAX_VERSIONS:]


def normalize_event(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A validated copy of a SchedulerEvent-like dict; ValueError if malformed."""
    if not isinstance(raw, Mapping):
        raise ValueError("event must be a mapping")
    seq = _int(raw, "seq")
    if seq < 0:
        raise ValueError(f"bad seq {seq}")
    time_s = raw.get("time_s", 0.0)
    if isinstance(time_s, bool) or not isinstance(time_s, int | float):
        raise ValueError(f"bad time_s {time_s!r}")
    out: dict[str, Any] = {"seq": seq, "time_s": float(time_s)}
    for key, limit in (("kind", 64), ("message", 1000), ("cell_id", 128), ("execution_id", 128)):
        value = raw.get(key) or ""
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string")
        out[key] = value[:limit]
    for key in ("waterlevel", "capacity", "ready_groups"):
        out[key] = _int(raw, key)
    return out


def cell_order(cell: Mapping[str, Any]) -> tuple[int, int, str]:
    """Display order: elastic cells by index (core first, then satellites), then the rest."""
    if cell.get("kind") == "ELASTIC":
        return (0, int(cell.get("index", 0)), str(cell["cell_id"]))
    return (1, 0, str(cell["cell_id"]))


def role_label(cell: Mapping[str, Any]) -> str:
    """ "core", "satellite 2", "standalone" (what the elastic index means)."""
    if cell.get("kind") == "ELASTIC":
        index = int(cell.get("index", 0))
        return "core" if index == 0 else f"satellite {index}"
    if cell.get("kind") == "STANDALONE":
        return "standalone"
    return "unknown"


@dataclasses.dataclass
class SourceStats:
    """How polling goes: counts and the last error (shown on the page and in /healthz)."""

    polls: int = 0
    ok: int = 0
    errors: int = 0
    stale: int = 0
    events: int = 0
    event_errors: int = 0
    last_ok_s: float | None = None
    last_error: str = ""
    last_error_s: float | None = None


class Timeline:
    """Folds status snapshots into bands, series and counters; bounded to ``max_samples``.

    Times are seconds on the caller's clock (the dashboard passes seconds since it started).
    """

    def __init__(
        self, max_samples: int = 7200, max_events: int = 200, max_training: int = MAX_TRAINING
    ) -> None:
        if max_samples < 2 or max_events < 1 or max_training < 1:
            raise ValueError("max_samples must be >= 2, max_events and max_training >= 1")
        self.max_samples = max_samples
        self.max_training = max_training
        self._training: dict[int, dict[str, Any]] = {}
        """Training diagnostics by the policy version they produced (the newest kept)."""
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._t: deque[float] = deque()
        self._series: dict[str, deque[int]] = {k: deque() for k in SERIES_FIELDS}
        self._bands: dict[str, list[list[Any]]] = {}
        self._cells: dict[str, dict[str, Any]] = {}
        self._policy_marks: list[list[float | int]] = []
        self._version_w: dict[int, deque[int]] = {}
        """Open executions (W) per policy version, one value per sample."""
        self._latest: dict[str, Any] | None = None
        self._epoch = 0
        self.stats = SourceStats()

    @property
    def latest(self) -> dict[str, Any] | None:
        return self._latest

    @property
    def last_t_s(self) -> float:
        """Time of the newest sample (0.0 when empty)."""
        return self._t[-1] if self._t else 0.0

    def __len__(self) -> int:
        return len(self._t)

    def record_error(self, t_s: float, message: str) -> None:
        """Counts a failed poll; the timeline keeps its last good state."""
        self.stats.polls += 1
        self.stats.errors += 1
        self.stats.last_error = message[:500]
        self.stats.last_error_s = t_s

    def add_event(self, raw_event: Mapping[str, Any]) -> bool:
        """Keeps one scheduler event; False for a duplicate (a stream replayed after a
        reconnect). Raises ValueError for a malformed event (nothing changes)."""
        event = normalize_event(raw_event)
        key = (event["seq"], event["kind"], event["time_s"])
        if any((e["seq"], e["kind"], e["time_s"]) == key for e in self._events):
            return False
        self._events.append(event)
        self.stats.events += 1
        return True

    def add(self, t_s: float, raw_status: Mapping[str, Any]) -> bool:
        """Adds one snapshot taken at ``t_s``; False when it was ignored (stale epoch).

        Raises ValueError for a malformed status (counted as an error, nothing changes).
        """
        self.stats.polls += 1
        try:
            status = normalize_status(raw_status)
        except ValueError as exc:
            self.stats.errors += 1
            self.stats.last_error = f"malformed status: {exc}"
            self.stats.last_error_s = t_s
            raise
        if self._t and t_s < self._t[-1]:
            raise ValueError(f"time went backwards: {t_s} < {self._t[-1]}")
        if status["leader"] is False or status["epoch"] < self._epoch:
            self.stats.stale += 1
            return False
        self._epoch = status["epoch"]
        self.stats.ok += 1
        self.stats.last_ok_s = t_s
        self._append_series(t_s, status)
        self._update_bands(t_s, status)
        if self._latest is None or status["policy_version"] != self._latest["policy_version"]:
            self._policy_marks.append([t_s, status["policy_version"]])
        self._add_training(t_s, status["training"])
        self._latest = status
        self._trim()
        return True

    def _add_training(self, t_s: float, training: dict[str, Any] | None) -> None:
        """One entry per version, stamped when first seen (every poll repeats the newest)."""
        if training is None or training["policy_version"] in self._training:
            return
        version = training["policy_version"]
        self._training[version] = {
            "version": version,
            "t_s": t_s,
            **{k: training[k] for k in TRAINING_SCALARS},
        }
        while len(self._training) > self.max_training:
            del self._training[min(self._training)]

    def _append_series(self, t_s: float, status: dict[str, Any]) -> None:
        self._t.append(t_s)
        ledger = status["ledger"]
        for key in SERIES_FIELDS:
            self._series[key].append(ledger[key] if key in ledger else status[key])
        now = {v["policy_version"]: v["waterlevel"] for v in status["versions"]}
        n = len(self._t)
        for version in now:
            if version not in self._version_w:
                self._version_w[version] = deque([0] * (n - 1))
        for version, series in self._version_w.items():
            series.append(now.get(version, 0))

    def _update_bands(self, t_s: float, status: dict[str, Any]) -> None:
        present = set()
        for cell in status["cells"]:
            cell_id = cell["cell_id"]
            present.add(cell_id)
            self._cells[cell_id] = dict(cell)
            self._extend(cell_id, t_s, cell["state"])
        for cell_id, meta in self._cells.items():
            if cell_id not in present:
                meta["state"] = GONE
                meta["routed"] = 0
                self._extend(cell_id, t_s, GONE)

    def _extend(self, cell_id: str, t_s: float, state: str) -> None:
        bands = self._bands.setdefault(cell_id, [])
        if bands and bands[-1][2] == state:
            bands[-1][1] = t_s
            return
        if bands:
            bands[-1][1] = t_s  # the previous state lasted until this sample
        bands.append([t_s, t_s, state])

    def _trim(self) -> None:
        while len(self._t) > self.max_samples:
            self._t.popleft()
            for series in self._series.values():
                series.popleft()
            for vseries in self._version_w.values():
                vseries.popleft()
        for version in [v for v, vs in self._version_w.items() if not any(vs)]:
            del self._version_w[version]  # no open work of this version in the window
        start = self._t[0]
        for cell_id in list(self._bands):
            bands = [b for b in self._bands[cell_id] if b[1] >= start]
            for b in bands:
                b[0] = max(b[0], start)
            if bands and not all(b[2] == GONE for b in bands):
                self._bands[cell_id] = bands
            else:  # gone for the whole window: forget the cell
                del self._bands[cell_id]
                self._cells.pop(cell_id, None)
        marks = [m for m in self._policy_marks if m[0] >= start]
        self._policy_marks = marks

    def to_json(self, now_s: float, window_s: float | None = None) -> dict[str, Any]:
        """What ``GET /api/timeline`` returns (plain JSON types only); with ``window_s``, only
        the samples, bands and marks of the last ``window_s`` seconds of the timeline (the
        per-version ``training`` list is not cut: versions, not samples, are its axis)."""
        latest = self._latest
        cells = sorted(self._cells.values(), key=cell_order)
        counters: dict[str, Any] = {}
        if latest is not None:
            counters = {k: latest[k] for k in STATUS_FIELDS}
            counters.update({k: latest["ledger"][k] for k in LEDGER_FIELDS})
            counters["finished_by_status"] = dict(latest["ledger"]["finished_by_status"])
            counters["policy"] = latest["policy"]
            counters.update({f"total_{k}": v for k, v in latest["total"].items()})
            counters["versions"] = [dict(v) for v in latest["versions"]]
        start = float("-inf") if window_s is None or not self._t else self._t[-1] - window_s
        first = bisect.bisect_left(self._t, start)
        bands = {
            c["cell_id"]: [
                [max(b[0], start), b[1], b[2]] for b in self._bands.get(c["cell_id"], []) if b[1] >= start
            ]
            for c in cells
        }
        return {
            "now_s": now_s,
            "cells": [{**c, "role": role_label(c)} for c in cells],
            "bands": bands,
            "series": {"t": list(self._t)[first:], **{k: list(v)[first:] for k, v in self._series.items()}},
            "policy_marks": [list(m) for m in self._policy_marks if m[0] >= start],
            "version_w": {str(v): list(vs)[first:] for v, vs in sorted(self._version_w.items())},
            "events": sorted(self._events, key=lambda e: (e["time_s"], e["seq"]), reverse=True),
            "counters": counters,
            "training": [dict(self._training[v]) for v in sorted(self._training)],
            "training_latest": _copy_training(latest["training"]) if latest is not None else None,
            "source": dataclasses.asdict(self.stats),
        }


def _copy_training(training: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if training is None else {**training, "lag_hist": list(training["lag_hist"])}
