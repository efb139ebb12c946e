"""Every back-off in the tree has jitter: retry loops use gyre.backoff.Backoff (capped
exponential, each delay drawn from [ceiling/2, ceiling]), never a hand-rolled doubling that
makes every client retry in lockstep."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from gyre.backoff import Backoff

ROOT = Path(__file__).resolve().parents[2]
_HAND_ROLLED = re.compile(r"\b\w*(backoff|delay)\w*\s*(\*=\s*2\b|=\s*min\(\s*\w*(backoff|delay)\w*\s*\*\s*2)")


def test_delays_are_jittered_within_a_doubling_capped_ceiling():
    b = Backoff(0.1, 1.0, rng=random.Random(1))
    ceilings = []
    delays = []
    for _ in range(8):
        ceilings.append(b.ceiling_s)
        delays.append(b.next())
    assert ceilings == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0])
    for c, d in zip(ceilings, delays, strict=True):
        assert c / 2 <= d <= c
    b.reset()
    assert b.ceiling_s == 0.1


def test_two_clients_do_not_retry_in_lockstep():
    a, b = Backoff(0.1, 2.0, rng=random.Random(1)), Backoff(0.1, 2.0, rng=random.Random(2))
    assert [a.next() for _ in range(6)] != [b.next() for _ in range(6)]
    many = {round(Backoff(0.1, 2.0).next(), 6) for _ in range(50)}
    assert len(many) > 40  # spread, not one instant


async def test_sleep_uses_the_injected_sleeper():
    slept: list[float] = []

    async def sleeper(s: float) -> None:
        slept.append(s)

    b = Backoff(0.2, 0.4, sleep=sleeper)
    got = [await b.sleep() for _ in range(3)]
    assert slept == got and all(0.1 <= s <= 0.4 for s in slept)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_no_hand_rolled_back_off_is_left_in_the_tree():
    offenders = []
    for top in ("gyre", "services", "apps", "sim", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _HAND_ROLLED.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "back-offs without jitter (use gyre.backoff.Backoff):\n" + "\n".join(offenders)
