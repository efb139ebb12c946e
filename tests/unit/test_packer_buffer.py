"""Packer trajectory buffer: a group is ready only when all its executions closed; failed
members follow the configured rule (never silently); GRPO advantages are group-relative;
zero-variance and stale groups are dropped and counted; malformed or conflicting records are
refused with a precise error and change nothing (state and WAL identical before and after)."""

from __future__ import annotations

import asyncio
import math

import pytest

from gyre.errors import FailedPrecondition, FatalError, InvalidArgument, NotFound, ResourceExhausted
from gyre.execution import ExecutionStatus
from gyre.v1 import common_pb2, packer_pb2
from services.packer.advantages import group_advantages, is_stale
from services.packer.model import Finish, Turn
from services.packer.packer import Packer
from services.packer.wal import MemoryLog
from testkit import packer_kit as tk


async def test_group_ready_only_when_all_members_closed():
    p, _, _ = tk.make_packer()
    for k in range(3):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 3, reward=0.0))
    await p.report_finish(tk.finish("x1", "g", 3, reward=1.0))
    assert p.supply()["ready_unassigned"] == 0
    assert p.state.counters()["pending"] == 3
    await p.report_finish(tk.finish("x2", "g", 3, reward=2.0))
    assert p.supply()["ready_unassigned"] == 1
    assert p.state.counters()["ready"] == 3


async def test_turns_arriving_during_the_grace_period_are_kept():
    p, _, clock = tk.make_packer(ready_grace_s=1.0)
    await p.record_turn(tk.turn("x0", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 2, reward=0.0))
    await p.report_finish(tk.finish("x1", "g", 2, reward=1.0))
    # x1's turn is still in the router's send queue when its finish arrives.
    clock.advance(0.5)
    await p.reap()
    assert p.supply()["ready_unassigned"] == 0
    await p.record_turn(tk.turn("x1", "g", 0))
    clock.advance(0.6)
    await p.reap()
    assert p.supply()["ready_unassigned"] == 1 and p.state.counters()["ready"] == 2
    with pytest.raises(FailedPrecondition):
        await p.record_turn(tk.turn("x1", "g", 1))  # too late now: refused and counted
    assert p.counters()["late_turns"] == 1 and p.state.counters()["produced"] == 2


async def test_after_a_restart_no_group_is_ready_before_the_routers_queued_turns_get_in():
    """The packer was down; a harness finished meanwhile and the router still holds the turn
    of its last call (retrying with back-off). After the restart the scheduler's relay of the
    finish report comes first: the group must wait ``restart_grace_s``, not just
    ``ready_grace_s``, or the turn is refused and lost (seen with a packer SIGKILLed under the
    demo while the routers' turn wait was shorter than its restart)."""
    p, log, clock = tk.make_packer(ready_grace_s=1.0, restart_grace_s=10.0)
    await p.record_turn(tk.turn("x0", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 2, reward=0.0))
    q = Packer(p.cfg, log, clock=clock)  # the restart
    q.recover(list(log.events))
    await q.report_finish(tk.finish("x1", "g", 2, reward=1.0))  # the relay, before the turn
    clock.advance(5.0)
    await q.reap()
    assert q.supply()["ready_unassigned"] == 0
    await q.record_turn(tk.turn("x1", "g", 0))  # the router's retry: kept
    clock.advance(5.1)
    await q.reap()
    assert q.supply()["ready_unassigned"] == 1 and q.state.counters()["ready"] == 2
    assert q.counters()["late_turns"] == 0
    # A first start (the service's log then holds only its new header): only the ready grace.
    first = Packer(tk.config(ready_grace_s=1.0, restart_grace_s=10.0), MemoryLog(), clock=clock)
    first.recover([{"t": "wal", "id": "fresh"}])
    await first.record_turn(tk.turn("y0", "h", 0))
    await first.record_turn(tk.turn("y1", "h", 0))
    await first.report_finish(tk.finish("y0", "h", 2, reward=0.0))
    await first.report_finish(tk.finish("y1", "h", 2, reward=1.0))
    clock.advance(1.1)
    await first.reap()
    assert first.supply()["ready_unassigned"] == 1


async def test_finish_without_turns_is_accepted_and_counts_as_closed():
    # Decision: a finish for an execution the packer never saw a turn of is legitimate (it
    # made no model call, or failed before one); it closes that member of its group.
    p, _, _ = tk.make_packer()
    await p.record_turn(tk.turn("x0", "g"))
    assert await p.report_finish(tk.finish("x1", "g", 2, reward=0.0)) is False
    await p.report_finish(tk.finish("x0", "g", 2, reward=1.0))
    assert p.supply()["ready_unassigned"] == 1


@pytest.mark.parametrize(
    "status", [ExecutionStatus.FAILED, ExecutionStatus.TIMED_OUT, ExecutionStatus.CANCELLED]
)
async def test_failed_member_drops_group_under_drop_group(status):
    p, _, _ = tk.make_packer(failed_member_rule="drop_group")
    for k in range(3):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
        await p.record_turn(tk.turn(f"x{k}", "g", 1))
    await p.report_finish(tk.finish("x0", "g", 3, reward=0.0))
    await p.report_finish(tk.finish("x1", "g", 3, reward=1.0))
    await p.report_finish(tk.finish("x2", "g", 3, status=status))
    c = p.state.counters()
    assert c["dropped"] == {"failed_group": 6}
    assert c["buffered"] == 0 and p.supply()["ready_unassigned"] == 0


async def test_keep_rest_drops_only_failed_members():
    p, _, _ = tk.make_packer(failed_member_rule="keep_rest", min_group_members=2)
    for k in range(3):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 3, reward=0.0))
    await p.report_finish(tk.finish("x1", "g", 3, status=ExecutionStatus.FAILED))
    await p.report_finish(tk.finish("x2", "g", 3, reward=2.0))
    c = p.state.counters()
    assert c["dropped"] == {"failed_execution": 1}
    assert c["ready"] == 2
    adv = p.state.groups["g"].advantages
    assert set(adv) == {"x0", "x2"}
    assert adv["x0"] == pytest.approx(-1.0, abs=1e-5) and adv["x2"] == pytest.approx(1.0, abs=1e-5)


async def test_keep_rest_with_too_few_completed_drops_group():
    p, _, _ = tk.make_packer(failed_member_rule="keep_rest", min_group_members=2)
    for k in range(2):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 2, reward=1.0))
    await p.report_finish(tk.finish("x1", "g", 2, status=ExecutionStatus.CANCELLED))
    assert p.state.counters()["dropped"] == {"failed_group": 2}


async def test_zero_variance_group_dropped_or_kept_by_option():
    p, _, _ = tk.make_packer(drop_zero_variance=True)
    for k in range(2):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
        await p.report_finish(tk.finish(f"x{k}", "g", 2, reward=1.0))
    assert p.state.counters()["dropped"] == {"zero_variance": 2}

    p, _, _ = tk.make_packer(drop_zero_variance=False)
    for k in range(2):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
        await p.report_finish(tk.finish(f"x{k}", "g", 2, reward=1.0))
    assert p.state.counters()["ready"] == 2
    assert p.state.groups["g"].advantages == {"x0": 0.0, "x1": 0.0}


def test_grpo_advantages_are_group_relative():
    adv = group_advantages({"a": 0.0, "b": 1.0, "c": 2.0, "d": 5.0}, std_normalize=True, eps=0.0)
    assert math.fsum(adv.values()) == pytest.approx(0.0, abs=1e-12)
    std = math.sqrt(sum(v * v for v in adv.values()) / 4)
    assert std == pytest.approx(1.0)
    raw = group_advantages({"a": 0.0, "b": 1.0, "c": 2.0, "d": 5.0}, std_normalize=False)
    assert raw == {"a": -2.0, "b": -1.0, "c": 0.0, "d": 3.0}
    assert group_advantages({"a": 3.0}) == {"a": 0.0}


def test_staleness_rule():
    assert not is_stale(5, 6, 1)
    assert is_stale(4, 6, 1)
    assert not is_stale(6, 6, 0)


async def test_stale_group_dropped_at_readiness_and_when_policy_moves():
    p, _, _ = tk.make_packer(max_staleness=1)
    await p.observe_policy(3)
    # Oldest token from version 1: two behind -> stale on arrival.
    await p.record_turn(tk.turn("a0", "old", 0, version=1))
    await p.record_turn(tk.turn("a1", "old", 0, version=2))
    await p.report_finish(tk.finish("a0", "old", 2, reward=0.0, version=1))
    await p.report_finish(tk.finish("a1", "old", 2, reward=1.0, version=2))
    assert p.state.counters()["dropped"] == {"stale": 2}
    # Fresh group: ready; then the policy moves two versions: dropped while waiting.
    await p.record_turn(tk.turn("b0", "new", 0, version=3))
    await p.record_turn(tk.turn("b1", "new", 0, version=3))
    await p.report_finish(tk.finish("b0", "new", 2, reward=0.0, version=3))
    await p.report_finish(tk.finish("b1", "new", 2, reward=1.0, version=3))
    assert p.supply()["ready_unassigned"] == 1
    await p.observe_policy(5)
    assert p.supply()["ready_unassigned"] == 0
    assert p.state.counters()["dropped"] == {"stale": 4}
    assert p.supply()["dropped"] == {"stale": 4}


async def test_group_dispatched_too_long_ago_is_dropped_as_unconsumable():
    """The cancel-early rule (gyre.staleness), by the version a group was dispatched with:
    its tokens may be fresh (engines moved on mid-episode), but no batch within eta takes
    a group stamped 1 once the trainer is at 3 (eta 1), nor at 2 once batch 2 is full."""
    p, _, _ = tk.make_packer(max_staleness=1)
    await p.observe_policy(3)
    for k in range(2):
        await p.record_turn(tk.turn(f"a{k}", "old", 0, version=3))
        await p.report_finish(tk.finish(f"a{k}", "old", 2, reward=float(k), version=1))
    assert p.state.counters()["dropped"] == {"unconsumable": 2}
    for k in range(2):
        await p.record_turn(tk.turn(f"b{k}", "ok", 0, version=3))
        await p.report_finish(tk.finish(f"b{k}", "ok", 2, reward=float(k), version=2))
    assert p.supply()["ready_unassigned"] == 1  # stamped 2, trainer at 3: still consumable


async def test_duplicates_are_idempotent():
    p, log, _ = tk.make_packer()
    assert await p.record_turn(tk.turn("x0", "g")) is False
    n = len(log.events)
    assert await p.record_turn(tk.turn("x0", "g")) is True
    assert await p.report_finish(tk.finish("x0", "g", 2, reward=0.5)) is False
    m = len(log.events)
    assert await p.report_finish(tk.finish("x0", "g", 2, reward=0.5)) is True
    assert len(log.events) == m and m == n + 1
    assert p.state.counters()["produced"] == 1


def _turn_proto(**changes):
    msg = tk.turn_proto("x0", "g", 0, prompt=4, output=4)
    for key, value in changes.items():
        field = getattr(msg, key)
        del field[:]
        field.extend(value)
    return msg


@pytest.mark.parametrize(
    "msg, error",
    [
        (_turn_proto(output_logprobs=[-0.1] * 3), InvalidArgument),
        (_turn_proto(output_logprobs=[-0.1, float("nan"), -0.1, -0.1]), InvalidArgument),
        (_turn_proto(output_logprobs=[-0.1, float("inf"), -0.1, -0.1]), InvalidArgument),
        (_turn_proto(output_logprobs=[-0.1, 0.5, -0.1, -0.1]), InvalidArgument),
        (_turn_proto(output_policy_versions=[0, 0]), InvalidArgument),
        (_turn_proto(output_loss_mask=[1, 2, 1, 1]), InvalidArgument),
        (_turn_proto(output_loss_mask=[1, 1]), InvalidArgument),
        (_turn_proto(output_token_ids=[], output_logprobs=[], output_policy_versions=[]), InvalidArgument),
        (_turn_proto(prompt_token_ids=[-1, 2]), InvalidArgument),
        (_turn_proto(prompt_token_ids=[]), InvalidArgument),
        (packer_pb2.TurnRecord(group_id="g", output_token_ids=[1], output_logprobs=[-1.0]), InvalidArgument),
        (
            packer_pb2.TurnRecord(execution_id="x", output_token_ids=[1], output_logprobs=[-1.0]),
            InvalidArgument,
        ),
        (
            packer_pb2.TurnRecord(
                execution_id="x" * 300, group_id="g", output_token_ids=[1], output_logprobs=[-1.0]
            ),
            InvalidArgument,
        ),
        (
            packer_pb2.TurnRecord(
                execution_id="x", group_id="g", turn_index=-1, output_token_ids=[1], output_logprobs=[-1.0]
            ),
            InvalidArgument,
        ),
        (_turn_proto(prompt_token_ids=list(range(70))), ResourceExhausted),  # budget is 64
    ],
)
async def test_malformed_turn_refused_and_changes_nothing(msg, error):
    p, log, _ = tk.make_packer()
    await tk.feed_group(p, "g0", size=2)
    before, n = tk.snapshot(p.state), len(log.events)
    with pytest.raises(error):
        await p.record_turn(Turn.from_proto(msg, p.cfg.micro_step_token_budget))
    assert tk.snapshot(p.state) == before and len(log.events) == n


@pytest.mark.parametrize(
    "changes",
    [
        {"reward": float("nan")},
        {"reward": float("inf")},
        {"status": common_pb2.EXECUTION_STATUS_RUNNING},
        {"status": common_pb2.EXECUTION_STATUS_UNSPECIFIED},
        {"group_size": 0},
        {"group_size": 1 << 20},
        {"policy_version": -1},
        {"execution_id": ""},
    ],
)
async def test_malformed_finish_refused(changes):
    p, log, _ = tk.make_packer()
    msg = tk.finish_proto("x0", "g", 2)
    for key, value in changes.items():
        setattr(msg, key, value)
    with pytest.raises(InvalidArgument):
        Finish.from_proto(msg, p.cfg.max_group_size)
    assert len(log.events) == 1  # only the first batch's creation


async def test_conflicting_records_refused_and_change_nothing():
    p, log, _ = tk.make_packer()
    await p.record_turn(tk.turn("x0", "g", 0))
    await p.report_finish(tk.finish("x0", "g", 2, reward=0.0))
    await tk.feed_group(p, "done", size=2)
    before, n = tk.snapshot(p.state), len(log.events)
    cases = [
        (p.record_turn(tk.turn("x0", "g", 0, output=5)), FailedPrecondition),  # same key, other content
        (p.record_turn(tk.turn("x0", "other", 1)), InvalidArgument),  # execution moved groups
        (p.report_finish(tk.finish("x0", "g", 2, reward=1.0)), FailedPrecondition),  # other reward
        (p.report_finish(tk.finish("x1", "g", 3)), InvalidArgument),  # other group_size
        (p.report_finish(tk.finish("x9", "done", 2)), FailedPrecondition),  # group already complete
        (p.record_turn(tk.turn("done-x0", "done", 5)), FailedPrecondition),  # late turn
        (p.ack("c", 0, "b9-m9"), NotFound),  # unknown micro-step
        (p.claim("c", 7, 0, 0), NotFound),  # unknown batch
    ]
    for coro, error in cases:
        with pytest.raises(error):
            await coro
    assert tk.snapshot(p.state) == before and len(log.events) == n


async def test_buffer_limit_is_resource_exhausted():
    p, log, _ = tk.make_packer(max_buffered_turns=2)
    await p.record_turn(tk.turn("x0", "g", 0))
    await p.record_turn(tk.turn("x0", "g", 1))
    with pytest.raises(ResourceExhausted):
        await p.record_turn(tk.turn("x0", "g", 2))
    assert p.state.counters()["produced"] == 2


def test_packed_sequence_alignment():
    t = Turn.validated("x", "g", 0, [1, 2, 3], [7, 8], [-0.1, -0.2], [4, 5], [1, 0], 100)
    from services.packer.model import PackedSequence
    from services.packer.segments import Segment

    msg = PackedSequence(Segment((t,)), 0.5, 4).to_proto()
    assert list(msg.token_ids) == [1, 2, 3, 7, 8]
    assert list(msg.loss_mask) == [0, 0, 0, 1, 0]
    assert list(msg.logprobs) == pytest.approx([0, 0, 0, -0.1, 0])
    assert list(msg.token_policy_versions) == [0, 0, 0, 4, 5]
    assert msg.advantage == 0.5 and msg.policy_version == 4 and msg.turn_index == 0 and msg.turns == 1


async def test_invariants_are_recounted_by_the_reaper_when_not_after_every_change():
    """The service recounts conservation every reap interval (``check_every_change`` off, the
    default): a broken count still ends the process, within one interval."""
    log, clock = MemoryLog(), tk.ManualClock()
    p = Packer(tk.config(reap_interval_s=0.01), log, clock=clock, strict=False)
    p.recover([])
    await p.record_turn(tk.turn("x0", "g", 0))
    p.state.produced += 1  # a bug: a turn counted that no structure holds
    await p.record_turn(tk.turn("x1", "g", 0))  # not checked on the change itself
    with pytest.raises(FatalError, match="conservation broken"):
        await asyncio.wait_for(p.run_reaper(), 5)


@pytest.mark.parametrize("rule", ["cancel", "partial"])
async def test_a_restamped_group_is_judged_by_its_stamp_under_the_partial_rule(rule):
    """A group the scheduler restamped (partial rule): its first member closed before the
    restamp (reported v1), the second after (v3); its first tokens came from v1. Trainer
    at v3, eta 1. Under partial its stamp is the newest report (3) and its old tokens are
    kept: ready. Under cancel the oldest token (v1) makes it stale."""
    p, _, _ = tk.make_packer(max_staleness=1, stale_rule=rule)
    await p.observe_policy(3)
    await p.record_turn(tk.turn("a0", "g", 0, version=1))
    await p.record_turn(tk.turn("a1", "g", 0, version=3))
    await p.report_finish(tk.finish("a0", "g", 2, reward=0.0, version=1))
    await p.report_finish(tk.finish("a1", "g", 2, reward=1.0, version=3))
    if rule == "partial":
        assert p.state.stamp(p.state.groups["g"]) == 3
        assert p.supply()["ready_unassigned"] == 1 and not p.state.counters()["dropped"]
    else:
        assert p.state.counters()["dropped"] == {"stale": 2}
