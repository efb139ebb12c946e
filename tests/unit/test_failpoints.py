"""gyre.failpoints: armed by environment or by a file re-read at every hit; the modes."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.failpoints import (
    EXIT_STATUS,
    FAILPOINT_ENV,
    FAILPOINT_FILE_ENV,
    FailpointCrash,
    failpoint,
    parse,
)

ROOT = Path(__file__).resolve().parents[2]


def test_parse_takes_commas_and_lines():
    assert parse(" a, b=raise\nc = enospc\n\n") == {"a": "", "b": "raise", "c": "enospc"}


def test_unarmed_does_nothing_and_the_modes_act(monkeypatch):
    monkeypatch.delenv(FAILPOINT_ENV, raising=False)
    monkeypatch.delenv(FAILPOINT_FILE_ENV, raising=False)
    failpoint("x")
    monkeypatch.setenv(FAILPOINT_ENV, "x=raise,y=enospc")
    with pytest.raises(FailpointCrash):
        failpoint("x")
    with pytest.raises(OSError) as err:
        failpoint("y")
    assert err.value.errno == errno.ENOSPC
    failpoint("z")


def test_a_file_arms_and_disarms_a_running_process(tmp_path, monkeypatch):
    armed = tmp_path / "fp"
    monkeypatch.delenv(FAILPOINT_ENV, raising=False)
    monkeypatch.setenv(FAILPOINT_FILE_ENV, str(armed))
    failpoint("x")  # no file yet
    armed.write_text("x=raise\n")
    with pytest.raises(FailpointCrash):
        failpoint("x")
    armed.unlink()
    failpoint("x")


def test_the_default_mode_exits_at_once_like_a_kill():
    code = "from gyre.failpoints import failpoint; failpoint('here'); print('went on')"
    env = {FAILPOINT_ENV: "here", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == EXIT_STATUS and "went on" not in out.stdout


def test_the_environment_is_parsed_once_per_value(monkeypatch):
    """A failpoint sits on hot paths (the packer's WAL write, every claim and turn): the
    variable is parsed once per value, not at every hit; a new value still takes effect."""
    import gyre.failpoints as fp

    calls: list[str] = []
    real = fp.parse
    monkeypatch.setattr(fp, "parse", lambda spec: calls.append(spec) or real(spec))
    monkeypatch.delenv(FAILPOINT_FILE_ENV, raising=False)
    monkeypatch.setenv(FAILPOINT_ENV, "only.here=raise,not.this")
    fp._parsed.cache_clear()
    for _ in range(100):
        failpoint("elsewhere")
    assert calls == ["only.here=raise,not.this"]
    monkeypatch.setenv(FAILPOINT_ENV, "elsewhere=raise")
    with pytest.raises(FailpointCrash):
        failpoint("elsewhere")
