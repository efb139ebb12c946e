"""A restarted satellite gets back into the training world although the core is busy.

A satellite that restarts finds its prefix groups' generation already formed and asks the
core for a new one; the core only re-forms with no batch in flight. A batch that waits for
data (the stream's last, partial batch, as `make compose-smoke` found: the restarted cell
waited for the core for good) must not hold that off: the request makes the controller
refuse joins and abandon the waiting batch at a consistent point (no micro-step half done,
no collective started), the groups re-form, and the next attempt at the batch gets every
micro-step back and trains it whole."""

from __future__ import annotations

import asyncio

import pytest

from gyre.errors import Unavailable
from services.cell_agent.training.config import TrainingSettings
from services.cell_agent.training.controller import TrainingController
from services.cell_agent.training.service import TrainingService
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.training_fakes import (
    core_controller,
)

pytestmark = pytest.mark.timeout(120)
STEPS = 4


class FakeGroups:
    """The prefix groups as keep_groups sees them: a peer asked for a new generation."""

    def __init__(self) -> None:
        self.world_size = 2
        self.asked = True
        self.reforms = 0

    def wants_reform(self) -> bool:
        return self.asked

    def reform(self) -> None:
        self.reforms += 1
        self.asked = False


async def _waiting_batch(packer: FakePacker, core: TrainingController) -> None:
    """Batch 1 with one of its micro-steps released: the core trains it, then waits."""
    packer.add_batch(1, 1, synthetic_batch(1, STEPS, seed=5), released=1)
    assert await core.join_batch(1, 1, 1, "")
    await asyncio.to_thread(packer.wait_claimed, 1, 1)


async def test_a_reform_request_abandons_the_waiting_batch_then_it_trains_whole():
    packer = FakePacker()
    core = core_controller(packer)
    await _waiting_batch(packer, core)
    core.request_reform("a peer asked")
    with pytest.raises(Unavailable):
        await asyncio.wait_for(core.wait_batch(1), 30)
    assert core.version == 1  # nothing stepped, nothing published
    assert core.publisher.published == []  # type: ignore[union-attr]
    with pytest.raises(Unavailable):
        await core.join_batch(1, 1, 1, "")  # refused until the groups are re-formed
    reformed = []
    await core.repair(lambda: reformed.append(1))
    assert reformed == [1] and core.broken is None
    packer.release(1)
    assert await core.join_batch(1, 1, 1, "")  # a new attempt: every micro-step again
    out = await asyncio.wait_for(core.wait_batch(1), 60)
    assert out.local_micro_steps == STEPS and out.new_version == 2
    assert packer.status(1) == (2, STEPS, True)  # two attempts, all acked, committed


async def _keep_groups_until(service: TrainingService, done) -> None:
    keeper = asyncio.create_task(service.keep_groups(every_s=0.01))
    try:
        for _ in range(3000):  # up to 30 s, as long as it takes on a loaded machine
            if done():
                break
            await asyncio.sleep(0.01)
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)


def _service(tmp_path, core: TrainingController, training: bool) -> tuple[TrainingService, FakeGroups]:
    service = TrainingService(TrainingSettings(model_dir=str(tmp_path)), cell_id="c0", index=0, target="c0:1")
    groups = FakeGroups()
    service.controller, service.groups = core, groups  # type: ignore[assignment]
    service.training = training
    return service, groups


async def test_keep_groups_reforms_although_a_batch_waits_for_data(tmp_path):
    packer = FakePacker()
    core = core_controller(packer)
    await _waiting_batch(packer, core)
    service, groups = _service(tmp_path, core, training=False)
    await _keep_groups_until(service, lambda: groups.reforms)
    assert groups.reforms == 1
    assert core.broken is None
    with pytest.raises(Unavailable):
        await core.wait_batch(1)  # the waiting attempt was given up; out of training: not retried


async def test_in_training_the_abandoned_batch_is_joined_again_and_trained(tmp_path):
    """The scheduler commanded the join once (a continuous policy commands the next after a
    new version, which this batch must produce): the cell joins it again by itself."""
    packer = FakePacker()
    core = core_controller(packer)
    await _waiting_batch(packer, core)
    service, groups = _service(tmp_path, core, training=True)
    await _keep_groups_until(service, lambda: packer.status(1)[0] >= 2)  # a second attempt opened
    assert groups.reforms == 1
    packer.release(1)
    out = await asyncio.wait_for(core.wait_batch(1), 60)
    assert out.local_micro_steps == STEPS and out.new_version == 2
    assert packer.status(1) == (2, STEPS, True)


async def test_a_training_build_that_fails_is_tried_again(tmp_path, monkeypatch):
    """A satellite whose prefix-group setup met the core's death (CI: DistNetworkError
    'Failed to recv' when the core was SIGKILLed mid-setup) builds again after a back-off
    instead of never training; meanwhile JoinBatch answers the failure. Before, one failure
    was final and the restarted core waited for this cell forever."""
    service = TrainingService(TrainingSettings(model_dir=str(tmp_path)), cell_id="c1", index=1, target="c1:1")
    builds: list[int] = []
    answered: list[str] = []
    kept = asyncio.Event()

    async def build():
        builds.append(1)
        if len(builds) == 1:
            raise RuntimeError("DistNetworkError('Failed to recv, got 0 bytes.')")
        with pytest.raises(Unavailable) as err:  # between the attempts: the failure is the answer
            await service.ready(0.1)
        answered.append(str(err.value))
        service.controller = object()  # type: ignore[assignment]
        return service.controller

    async def keep_groups(every_s: float = 0.5) -> None:
        kept.set()

    async def close() -> None:
        pass

    monkeypatch.setattr(service, "build", build)
    monkeypatch.setattr(service, "keep_groups", keep_groups)
    monkeypatch.setattr(service, "close", close)
    await asyncio.wait_for(service.run(retry_base_s=0.01), 10)
    assert kept.is_set() and len(builds) == 2 and service._failed is None
    assert "Failed to recv" in answered[0]
