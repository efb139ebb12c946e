"""gyre.lifeline: children that die with their parent, and incarnation records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from gyre import lifeline
from gyre.lifeline import PARENT_ENV, PidFile, die_with_parent, spawn


def test_die_with_parent_ignores_its_own_pid_and_absent_variable():
    assert die_with_parent({}) == 0
    env = {PARENT_ENV: str(os.getpid())}
    assert die_with_parent(env) == 0 and env[PARENT_ENV] == str(os.getpid())  # the parent's own mark


def test_die_with_parent_leaves_a_grandparent_mark_alone():
    # A live process that is not our parent (it waits on its stdin until killed): a
    # grandchild's case. Not pid 1: a pytest started under nohup is init's child.
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        env = {PARENT_ENV: str(other.pid)}
        assert die_with_parent(env) == 0 and env[PARENT_ENV] == str(other.pid)
    finally:
        other.kill()
        other.wait()


def test_child_of_a_marked_parent_consumes_the_mark():
    code = (
        "import os; from gyre.lifeline import die_with_parent, PARENT_ENV; "
        "print(die_with_parent(), PARENT_ENV in os.environ)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, PARENT_ENV: str(os.getpid())},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [str(os.getpid()), "False"]


def test_spawned_child_dies_with_its_parent(tmp_path):
    # A middle process spawns a sleeper and is SIGKILLed: the sleeper must go with it.
    code = (
        "import sys, time; from gyre.lifeline import spawn; "
        "p = spawn(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        sleeper = psutil.Process(int(middle.stdout.readline()))
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 5
        while lifeline._running(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lifeline._running(sleeper)
    finally:
        middle.kill()


def test_spawn_from_any_thread_uses_one_long_lived_thread():
    import threading

    procs = []
    t = threading.Thread(target=lambda: procs.append(spawn(["true"])))
    t.start()
    t.join()  # the calling thread is gone; the child was forked by the spawner thread
    assert procs[0].wait(5) == 0


def test_pid_file_ends_only_the_recorded_live_processes(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        record = PidFile(tmp_path / "cell-x.json")
        record.write(os.getpid(), [psutil.Process(sleeper.pid)])
        assert [p.pid for p in record.live()] == [sleeper.pid]  # the owner (us) is never ended
        ended = record.end_stale()
        assert [e["pid"] for e in ended] == [sleeper.pid]
        assert sleeper.wait(5) == -9
        assert not record.path.exists() and record.end_stale() == []
    finally:
        sleeper.kill()


def test_pid_file_does_not_kill_a_reused_pid(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        record = PidFile(tmp_path / "cell-x.json")
        record.write(os.getpid(), [psutil.Process(sleeper.pid)])
        data = record.read()
        data["processes"][0]["start"] -= 100.0  # another process that once had this pid
        record.path.write_text(json.dumps(data))
        assert record.end_stale() == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
