"""Processes that die with the process that started them, and records of what a process
started so that its next incarnation can end what a crash left behind.

Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere the parent-death parts do nothing.

- **Children we start** (:func:`spawn`: the launcher's services and etcd, test processes):
  the child starts as this module, arms the parent-death signal (SIGKILL), checks that its
  parent is still the one that forked it (a parent that died before the signal was armed
  would never send it; it exits at once if not), then execs the program. The kernel sends the signal when the
  *thread* that forked the child exits, so every child is forked by one thread that lives
  as long as the process (:class:`_Spawner`), never by a short-lived worker thread.
- **Children a library starts** (vLLM's engine core): the parent puts its pid in the
  environment under :data:`PARENT_ENV` before the library starts them (:func:`mark_parent`);
  code that runs early in the child calls :func:`die_with_parent`, which does the same
  arming and check. The variable is consumed, so grandchildren do not inherit a pid that
  is not their parent's.
- **Incarnation records.** :class:`PidFile` keeps ``{pid, start time}`` of a process and
  what it started; :meth:`PidFile.end_stale` kills those still alive (the start time tells
  a live original from a reused pid).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import psutil

log = logging.getLogger(__name__)

PARENT_ENV = "GYRE_PARENT_PID"
"""The pid of the process this one must die with (consumed by :func:`die_with_parent`)."""

_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _libc_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send ``sig`` to this process when its parent (thread) exits.
    False where that is not supported (not Linux)."""
    if _PRCTL is None:
        return False
    if _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return True


def _arm(parent: int) -> None:
    """In a child (between fork and exec, or first thing after start): die with ``parent``."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def die_with_parent(env: MutableMapping[str, str] | None = None) -> int:
    """If :data:`PARENT_ENV` names this process's parent, makes this process die with it
    (SIGKILL), consumes the variable and returns the parent's pid. Exits at once (status 1)
    if the named process is gone (it died before the signal was armed). 0, changing
    nothing, when the variable is absent, names this process itself (the parent that set
    it for its children) or names a live ancestor further up (a grandchild, e.g. a worker
    an engine core starts: its own parent looks after it)."""
    environ = os.environ if env is None else env
    value = environ.get(PARENT_ENV, "")
    if not value.isdigit() or int(value) == os.getpid():
        return 0
    parent = int(value)
    if os.getppid() != parent:
        if psutil.pid_exists(parent):
            return 0
        os._exit(1)
    environ.pop(PARENT_ENV, None)
    _arm(parent)
    return parent


def mark_parent() -> None:
    """Children this process starts from now on (through any library) that call
    :func:`die_with_parent` die with this process."""
    os.environ[PARENT_ENV] = str(os.getpid())


class _Spawner:
    """One long-lived thread that starts every child: the parent-death signal follows the
    thread that forked the child, and a short-lived thread (a start-up worker, a restart
    timer) would take its children with it when it ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gyre-spawner", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return fn()
        reply: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                reply.put((False, exc))


_SPAWNER = _Spawner()


def spawn(args: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **popen)``, forked by the spawner thread, whose child dies
    (SIGKILL) when this process dies, however it dies.

    The child starts as this module (``python -P lifeline.py -- args``), which arms the
    signal, checks its parent and then ``exec``s ``args`` (the signal survives the exec).
    Not ``preexec_fn``: that makes Popen ``fork()`` a multi-threaded parent and run its
    fork handlers (gRPC's abort the child: "Check failed: next_worker->state == KICKED")."""
    env = dict(popen.pop("env", None) or os.environ)
    env[PARENT_ENV] = str(os.getpid())
    shim = [sys.executable, "-P", str(Path(__file__).resolve()), "--", *args]
    return _SPAWNER.run(lambda: subprocess.Popen(shim, env=env, **popen))


def _exec_main(argv: list[str]) -> None:
    """``python -P lifeline.py -- PROGRAM ARGS...``: die with the parent, then exec."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: lifeline.py -- PROGRAM [ARGS...]")
    die_with_parent()
    os.execvp(argv[0], argv)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty if it is gone)."""
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.NoSuchProcess:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def kill_all(procs: Iterable[psutil.Process], timeout_s: float = 5.0) -> list[psutil.Process]:
    """SIGKILLs each process (psutil checks it is still the same process) and waits;
    returns those still running after ``timeout_s`` (a zombie, dead but not yet reaped by
    its parent, counts as ended)."""
    procs = list(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _running(p)]
    return alive


def kill_group(pgid: int) -> None:
    """SIGKILL to process group ``pgid`` (whatever a dead group leader left); no-op if gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None


class PidFile:
    """What one incarnation of a process started: ``{"owner": {pid, start}, "processes":
    [{pid, start, name}, ...]}`` in one JSON file, replaced atomically."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, owner: int, processes: Iterable[psutil.Process]) -> None:
        """Records ``owner`` (this process) and ``processes`` (what it started)."""
        entries = []
        for p in processes:
            try:
                entries.append({"pid": p.pid, "start": p.create_time(), "name": p.name()})
            except psutil.NoSuchProcess:
                continue
        record = {
            "owner": {"pid": owner, "start": _start_time(owner)},
            "processes": entries,
            "written": time.time(),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def read(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def live(self) -> list[psutil.Process]:
        """The recorded processes (the owner first) that are still the same processes."""
        record = self.read()
        out: list[psutil.Process] = []
        for entry in [record.get("owner") or {}, *(record.get("processes") or [])]:
            pid, start = entry.get("pid"), entry.get("start")
            if not isinstance(pid, int) or pid == os.getpid() or start is None:
                continue
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - float(start)) < 0.01:
                    out.append(proc)
            except psutil.NoSuchProcess:
                continue
        return out

    def end_stale(self) -> list[dict[str, Any]]:
        """Kills what a previous incarnation recorded and left alive; returns what was
        ended (pid, name) for the log. The file is removed."""
        stale = self.live()
        ended = []
        for p in stale:
            try:
                ended.append({"pid": p.pid, "name": p.name()})
            except psutil.NoSuchProcess:
                continue
        alive = kill_all(stale)
        if alive:
            raise RuntimeError(f"could not end stale processes {[p.pid for p in alive]} ({self.path})")
        self.path.unlink(missing_ok=True)
        return ended

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


if __name__ == "__main__":
    _exec_main(sys.argv[1:])
