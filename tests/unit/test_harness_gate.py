"""A harness is who its API key or certificate says; nothing else gets a principal. Its
acquire rate and the executions it holds are bounded (RESOURCE_EXHAUSTED past either), and
only the harness that acquired an execution may act on it."""

from __future__ import annotations

import pytest

from gyre.apikeys import KeyFile, hash_key
from gyre.errors import PermissionDenied, RateLimited, ResourceExhausted, Unauthenticated
from gyre.identity import Identity, Role
from gyre.ratelimit import KeyedLimiter
from services.scheduler.harness_gate import HarnessGate

HARNESS = Identity(Role.HARNESS, "harness-a")
OPERATOR = Identity(Role.OPERATOR, "operator")


def test_principals():
    gate = HarnessGate(keys=KeyFile({"alice": hash_key("k1")}))
    assert gate.principal(HARNESS, None) == "harness-a"
    assert gate.principal(HARNESS, "k1") == "key:alice"
    with pytest.raises(Unauthenticated):
        gate.principal(HARNESS, "k2")
    with pytest.raises(Unauthenticated):
        gate.principal(OPERATOR, None)
    with pytest.raises(Unauthenticated):
        gate.principal(None, None, "claimed")  # no mTLS and trust not configured
    assert HarnessGate(keys=None, trust_unauthenticated=True).principal(None, None, "h1") == "h1"
    with pytest.raises(Unauthenticated):
        HarnessGate(keys=KeyFile({}), require_key=True).principal(HARNESS, None)
    with pytest.raises(Unauthenticated):
        HarnessGate(keys=None).principal(HARNESS, "k1")  # keys are not enabled


def test_rate_and_inflight_limits():
    now = [0.0]
    gate = HarnessGate(keys=None, max_inflight=2, rate_per_s=1.0, burst=2, clock=lambda: now[0])
    gate.admit_acquire("a")
    gate.admit_acquire("a")
    with pytest.raises(RateLimited):
        gate.admit_acquire("a")
    gate.admit_acquire("b")  # per harness
    now[0] = 1.0
    gate.admit_acquire("a")
    gate.launched("a")
    gate.launched("a")
    with pytest.raises(ResourceExhausted):
        gate.check_inflight("a")
    gate.closed("a")
    gate.check_inflight("a")
    gate.recount(["a", "a", "b", ""])
    assert gate.held == {"a": 2, "b": 1}


def test_only_the_owner_acts():
    HarnessGate.check_owner("harness-a", "harness-a")
    HarnessGate.check_owner("harness-a", None)  # authentication off
    with pytest.raises(PermissionDenied):
        HarnessGate.check_owner("harness-a", "harness-b")


def test_the_limiter_keeps_its_memory_bounded():
    lim = KeyedLimiter(1.0, 1, max_keys=3, clock=lambda: 0.0)
    for k in "abcde":
        assert lim.take(k) == 0.0
    assert lim.take("e") > 0  # e is remembered
    assert lim.take("a") == 0.0  # a was dropped (least recently used): a full bucket again
