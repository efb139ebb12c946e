"""The launcher's process supervisor: crash-only services that come back.

Like an orchestrator's restart policy (Kubernetes ``restartPolicy: Always``, compose
``restart: unless-stopped``): a supervised process that exits while the cluster runs is
restarted after a back-off, and rejoins by itself (services register in etcd at start-up;
a cell comes back with its cell id and elastic index). What it left running is ended first
(its process group). The back-off doubles per consecutive failure from
``backoff_initial_s`` up to ``backoff_max_s``, with jitter (each delay is drawn uniformly
from ``[(1 - jitter) * d, d]``), and starts over once a process has stayed up
``reset_after_s``. A process that exits more than ``max_restarts`` times within
``window_s`` is given up on (state ``failed``): the launcher and the demo then stop.

API (for the launcher, the demo and fault injection)::

    sup = Supervisor(policy, on_event=print, journal=run_dir / "supervisor.jsonl")
    sup.add(Child)             # anything with name / alive() / start() / after_exit() / pid
    sup.start()                # the monitor thread
    sup.restarts()             # {"cell-1": 2, ...}
    sup.events()               # [SupervisorEvent(t, name, kind, detail), ...]
    sup.status()               # [{"name", "state", "pid", "restarts", "last_exit"}, ...]
    sup.failed()               # names given up on
    sup.stop()                 # no more restarts (then stop the children yourself)

Event kinds: ``exited`` (rc), ``restarting`` (delay_s, attempt), ``restarted`` (pid,
down_s), ``restart_failed`` (error), ``gave_up`` (restarts, window_s), and the launcher's
``start_failed`` (error, attempt, delay_s: a first start that failed and is tried again,
:meth:`Supervisor.record`). Each is also one JSON line in the journal.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When and how fast the supervisor restarts a process (``launch.restart`` in the
    cluster YAML)."""

    enabled: bool = True
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.5
    reset_after_s: float = 60.0
    max_restarts: int = 10
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if not (
            0 <= self.jitter <= 1
            and self.backoff_initial_s >= 0
            and self.multiplier >= 1
            and self.backoff_max_s >= self.backoff_initial_s
            and self.max_restarts >= 0
            and self.window_s > 0
        ):
            raise ValueError(f"invalid restart policy: {self}")

    @classmethod
    def from_config(cls, section: dict[str, Any] | None) -> RestartPolicy:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(section or {}) - fields
        if unknown:
            raise ValueError(f"launch.restart: unknown fields {sorted(unknown)} (known: {sorted(fields)})")
        return cls(**(section or {}))

    def delay_s(self, failures: int, rng: random.Random) -> float:
        """The back-off before restart number ``failures`` (1-based) of a run of failures."""
        base = min(self.backoff_max_s, self.backoff_initial_s * self.multiplier ** max(0, failures - 1))
        return base * (1.0 - self.jitter * rng.random())


class Child(Protocol):
    """A supervised process."""

    name: str

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def start(self) -> Any:
        """Starts (again) and returns once it is ready; raises if it is not."""

    def after_exit(self) -> None:
        """Ends what the dead process left (its process group)."""

    def returncode(self) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class SupervisorEvent:
    t: float
    name: str
    kind: str
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"t": round(self.t, 3), "name": self.name, "kind": self.kind, **self.detail}


@dataclasses.dataclass
class _Slot:
    child: Child
    state: str = "running"  # running | backoff | starting | failed | stopped
    restarts: int = 0
    failures: int = 0  # consecutive (reset after a long enough run)
    exits: list[float] = dataclasses.field(default_factory=list)
    up_since: float = 0.0
    down_since: float = 0.0
    restart_at: float = 0.0
    last_exit: int | None = None


class Supervisor:
    """Restarts the processes added to it (see the module docstring)."""

    def __init__(
        self,
        policy: RestartPolicy | None = None,
        on_event: Callable[[SupervisorEvent], None] | None = None,
        journal: str | Path | None = None,
        poll_s: float = 0.2,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self._on_event = [on_event] if on_event else []
        self._journal = Path(journal) if journal else None
        self._poll_s = poll_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._events: list[SupervisorEvent] = []
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarting: list[threading.Thread] = []

    # Setup -----------------------------------------------------------------------------------

    def add(self, child: Child) -> None:
        """Supervises ``child`` (already started)."""
        with self._lock:
            self._slots[child.name] = _Slot(child, up_since=self._clock())

    def subscribe(self, callback: Callable[[SupervisorEvent], None]) -> None:
        self._on_event.append(callback)

    def start(self) -> Supervisor:
        if self._thread is None and self.policy.enabled:
            self._thread = threading.Thread(target=self._run, name="gyre-supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self, wait_s: float = 10.0) -> None:
        """No more restarts; waits for the monitor and up to ``wait_s`` for starts in
        progress (stop the children after this; :meth:`join_restarts`, then stop them again,
        catches a start that was still in progress)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.join_restarts(wait_s)
        with self._lock:
            for slot in self._slots.values():
                if slot.state != "failed":
                    slot.state = "stopped"

    def join_restarts(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in list(self._restarting):
            t.join(max(0.0, deadline - time.monotonic()))

    def record(self, name: str, kind: str, **detail: Any) -> None:
        """An event about a process that is not supervised yet (the launcher's first
        starts): kept with the others and journaled."""
        self._emit(name, kind, **detail)

    # Queries ---------------------------------------------------------------------------------

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return {name: s.restarts for name, s in self._slots.items()}

    def events(self) -> list[SupervisorEvent]:
        with self._lock:
            return list(self._events)

    def failed(self) -> list[str]:
        with self._lock:
            return [name for name, s in self._slots.items() if s.state == "failed"]

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for name, s in self._slots.items():
                alive = s.child.alive()
                out.append(
                    {
                        "name": name,
                        "state": s.state if s.state != "running" or alive else "exited",
                        "pid": s.child.pid if alive else None,
                        "restarts": s.restarts,
                        "last_exit": s.last_exit,
                    }
                )
            return out

    # Monitor ---------------------------------------------------------------------------------

    def _emit(self, name: str, kind: str, **detail: Any) -> None:
        event = SupervisorEvent(time.time(), name, kind, detail)
        with self._lock:
            self._events.append(event)
        if self._journal is not None:
            with self._journal.open("a") as f:
                f.write(json.dumps(event.to_json()) + "\n")
        (log.warning if kind in ("exited", "restart_failed", "gave_up", "start_failed") else log.info)(
            "supervisor: %s %s %s", name, kind, detail
        )
        for cb in self._on_event:
            cb(event)

    def _run(self) -> None:
        while not self._stopping.wait(self._poll_s):
            now = self._clock()
            with self._lock:
                slots = list(self._slots.items())
            for name, slot in slots:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    if slot.state == "running" and not slot.child.alive():
                        self._on_exit(name, slot, now)
                    if not (slot.state == "backoff" and now >= slot.restart_at):
                        continue
                    slot.state = "starting"
                    t = threading.Thread(
                        target=self._restart, args=(name, slot), name=f"restart-{name}", daemon=True
                    )
                    self._restarting = [r for r in self._restarting if r.is_alive()] + [t]
                    t.start()

    def _on_exit(self, name: str, slot: _Slot, now: float) -> None:
        slot.last_exit = slot.child.returncode()
        slot.child.after_exit()
        slot.down_since = now
        if now - slot.up_since >= self.policy.reset_after_s:
            slot.failures = 0
        slot.failures += 1
        slot.exits = [t for t in slot.exits if now - t < self.policy.window_s] + [now]
        self._emit(name, "exited", rc=slot.last_exit, up_s=round(now - slot.up_since, 3))
        if len(slot.exits) > self.policy.max_restarts:
            slot.state = "failed"
            self._emit(name, "gave_up", restarts=slot.restarts, window_s=self.policy.window_s)
            return
        delay = self.policy.delay_s(slot.failures, self._rng)
        slot.restart_at = now + delay
        slot.state = "backoff"
        self._emit(name, "restarting", delay_s=round(delay, 3), attempt=slot.failures)

    def _restart(self, name: str, slot: _Slot) -> None:
        if self._stopping.is_set():
            return
        try:
            slot.child.start()
        except Exception as exc:  # noqa: BLE001 - a failed start is one more failure, retried
            if self._stopping.is_set():
                return
            self._emit(name, "restart_failed", error=str(exc)[:500])
            with self._lock:  # still "starting": the monitor leaves it alone
                slot.up_since = self._clock()
                self._on_exit(name, slot, slot.up_since)
            return
        with self._lock:
            now = self._clock()
            slot.restarts += 1
            slot.up_since = now
            slot.state = "running"
        self._emit(
            name,
            "restarted",
            pid=slot.child.pid,
            down_s=round(now - slot.down_since, 3),
            restarts=slot.restarts,
        )
