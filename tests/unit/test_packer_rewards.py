"""Rewards have finite bounds on both ends, enforced before anything is logged: a reward of
1e154 (whose group std overflows to inf) is INVALID_ARGUMENT at the packer and at the
scheduler's config, and a WAL written before the bound (holding such a reward) replays
without crash-looping the packer: the group is dropped as ``invalid_reward``."""

from __future__ import annotations

import pydantic
import pytest

from gyre.errors import InvalidArgument
from services.packer.model import Finish
from services.packer.packer import Packer
from services.packer.wal import Wal
from services.scheduler.config import SchedulerConfig
from testkit import packer_kit as tk


@pytest.mark.parametrize("reward", [1e154, -1e154, 1e10, -2e9])
async def test_a_huge_reward_is_refused_before_anything_is_logged(reward):
    p, log, _ = tk.make_packer()
    await p.record_turn(tk.turn("x0", "g", 0))
    logged = len(log.events)
    with pytest.raises(InvalidArgument, match="reward"):
        Finish.from_proto(
            tk.finish_proto("x0", "g", 2, reward=reward), p.cfg.max_group_size, p.cfg.max_abs_reward
        )
    assert len(log.events) == logged


async def test_rewards_at_the_bound_are_accepted_and_give_finite_advantages():
    p, log, _ = tk.make_packer()
    for k, r in enumerate((1e9, -1e9)):
        await p.record_turn(tk.turn(f"x{k}", "g", 0))
        await p.report_finish(
            Finish.from_proto(tk.finish_proto(f"x{k}", "g", 2, reward=r), 256, p.cfg.max_abs_reward)
        )
    assert sorted(p.state.groups["g"].advantages.values()) == pytest.approx([-1.0, 1.0])


async def test_a_wal_holding_a_huge_reward_replays_without_crashing(tmp_path):
    # Written by a packer without the bound: two members, rewards 1e154 and -1e154.
    wal = Wal(tmp_path)
    wal.open()
    for k, r in enumerate((1e154, -1e154)):
        wal.append({"t": "turn", "turn": tk.turn(f"x{k}", "g", 0).to_json()})
        wal.append(
            {"t": "finish", "finish": {"x": f"x{k}", "g": "g", "n": 2, "s": "completed", "r": r, "v": 0}}
        )
    await wal.close()
    wal = Wal(tmp_path)
    events = wal.open()
    p = Packer(tk.config(), wal, clock=tk.ManualClock())
    p.recover(events)  # before: ValueError (an inf advantage cannot be logged) on every start
    await wal.sync()
    assert p.state.groups_dropped["invalid_reward"] == 1
    p.state.check(deep=True)
    await wal.close()


@pytest.mark.parametrize(
    "field,value",
    [
        ("reward_max", float("inf")),
        ("reward_min", float("-inf")),
        ("reward_max", float("nan")),
        ("reward_max", 1e154),
    ],
)
def test_the_scheduler_refuses_unbounded_reward_limits(field, value):
    with pytest.raises(pydantic.ValidationError):
        SchedulerConfig(**{field: value})
