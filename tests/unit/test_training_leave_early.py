"""A core told to leave training while alone in a batch it has trained nothing of leaves
at once, at the next WAIT, instead of draining a batch whose groups have not come in yet.

A breathing core joins the next batch as its publication goes out; a moment later the
scheduler tells it to roll out (nothing to train, executions waiting for slots). Draining,
it sat RETURNING until that batch's groups arrived and it had trained them: 24-45 s of the
demo's 4-cell rollout, in 3 of 4 returns of one run. It now leaves at the next WAIT: no
claim outstanding, nothing trained, so nothing is lost or kept, and the next attempt at the
batch trains it whole. With a micro-step trained, or a satellite in the batch (whose part
the core's reduce awaits), it drains as before."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.cell_agent.training.controller import TrainingController
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.training_fakes import (
    InProcessMembership,
    core_controller,
)

pytestmark = pytest.mark.timeout(120)
STEPS = 3


async def _leave_then_release(core: TrainingController, packer: FakePacker, after_s: float) -> float:
    """Leaves training; releases the batch's micro-steps ``after_s`` later (as the batch's
    groups arrive). The seconds the leave took."""

    async def release_later() -> None:
        await asyncio.sleep(after_s)
        packer.release(1)

    releasing = asyncio.create_task(release_later())
    t0 = time.monotonic()
    await asyncio.wait_for(core.on_leave_training(), 60)
    took = time.monotonic() - t0
    await releasing
    return took


async def test_the_core_alone_with_nothing_trained_leaves_at_once_and_the_batch_trains_whole_later():
    packer = FakePacker()
    core = core_controller(packer)
    packer.add_batch(1, 1, synthetic_batch(1, STEPS, seed=5), released=0)
    assert await core.join_batch(1, 1, 1, "")
    await asyncio.sleep(0.2)  # the core waits (WAIT after WAIT) for the batch's first groups
    took = await _leave_then_release(core, packer, after_s=5.0)
    assert took < 5.0  # before any micro-step came in (draining waited for the batch: >= 5 s)
    assert core.version == 1 and core.publisher.published == []  # type: ignore[union-attr]
    assert packer.claimed(1) == 0
    # Back in training: the scheduler joins it again; a new attempt trains every micro-step.
    assert await core.join_batch(1, 1, 1, "")
    out = await asyncio.wait_for(core.wait_batch(1), 60)
    assert out.local_micro_steps == STEPS and out.new_version == 2
    assert packer.status(1) == (2, STEPS, True)  # two attempts, all acked, committed


async def test_a_core_that_trained_a_micro_step_drains_the_batch():
    packer = FakePacker()
    core = core_controller(packer)
    packer.add_batch(1, 1, synthetic_batch(1, STEPS, seed=5), released=1)
    assert await core.join_batch(1, 1, 1, "")
    await asyncio.to_thread(packer.wait_claimed, 1, 1)
    took = await _leave_then_release(core, packer, after_s=1.0)
    assert took >= 1.0  # it waited for the rest of the batch and trained it
    out = await asyncio.wait_for(core.wait_batch(1), 5)
    assert out.local_micro_steps == STEPS and out.new_version == 2
    assert packer.status(1) == (1, STEPS, True)  # one attempt


async def test_a_core_with_a_satellite_in_the_batch_drains_it():
    packer = FakePacker()
    membership = InProcessMembership()
    core = core_controller(packer, membership)
    packer.add_batch(1, 1, synthetic_batch(1, STEPS, seed=5), released=0)
    assert await core.join_batch(1, 1, 1, "")
    membership.register(1, 1)  # a satellite joined: the core's reduce awaits its part
    await asyncio.sleep(0.2)
    leaving = asyncio.create_task(core.on_leave_training())
    await asyncio.sleep(1.0)
    assert not leaving.done()  # it keeps the batch
    assert membership.members(1) == 2
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await core.close()


def test_store_membership_counts_the_members_of_a_batch():
    """The rendezvous store's membership (what the services use) counts as the fake does."""
    import torch.distributed as dist

    from services.cell_agent.training.dist import StoreMembership

    m = StoreMembership(dist.HashStore())
    assert m.members(4) == 0
    m.open(4, 7)
    assert m.members(4) == 1
    m.register(4, 1)
    assert m.members(4) == 2
    assert m.freeze(4) == 2 and m.members(4) == 2
