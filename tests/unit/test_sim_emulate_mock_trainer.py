"""The cost-model trainer (services/cell_agent/training/mock_trainer.py): every micro-step of a
batch is trained exactly once across the participants, each costs tokens*6N/(FLOPS*MFU)
scaled, the core publishes version v+1 only after the packer says the batch is done, and
``build_hook`` picks it for ``training: {mode: mock}``."""

from __future__ import annotations

import asyncio
import types

import pytest

from gyre import config as config_mod
from gyre.v1 import packer_pb2 as ppb
from services.cell_agent.config import CellAgentConfig
from services.cell_agent.hooks import JoinBatch
from services.cell_agent.training import hook as hook_mod
from services.cell_agent.training.config import MockTrainerSettings
from services.cell_agent.training.microstep import Claim, MicroStep, Outcome, Sequence
from services.cell_agent.training.mock_trainer import MockTrainingHook, sequence_tokens
from testkit.fake_packer import FakePacker
from testkit.training_fakes import FakeSource


class CountingSource(FakeSource):
    """A cell's source that counts the claim calls that claimed something."""

    calls = 0

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        claims = await super().claim_many(batch_id, policy_version, wait_s, max_micro_steps, claim_id)
        if claims[0].outcome is Outcome.CLAIMED:
            self.calls += 1
        return claims


def _step(i: int, n: int) -> MicroStep:
    seq = Sequence(token_ids=tuple(range(3, 3 + n)), loss_mask=(0,) * n, logprobs=(0.0,) * n, advantage=1.0)
    return MicroStep(f"m{i}", 1, (seq,))


class Publisher:
    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []

    async def publish(self, version: int, batch_id: int) -> None:
        self.published.append((version, batch_id))


async def test_batch_trained_once_and_published_after_done() -> None:
    packer = FakePacker()
    packer.add_batch(1, 0, [_step(i, 100) for i in range(6)])
    sources = [CountingSource(packer, "c0"), CountingSource(packer, "c1")]

    async def batches(batch_id: int) -> ppb.BatchStatus:
        return packer.batch_status(batch_id)

    settings = MockTrainerSettings(
        segment_marker_id=-1,
        time_scale=0.001,
        n_params=1e9,
        flops=1e12,
        train_flops_eff=0.5,
        train_step_fixed_s=2.0,
        weight_sync_s=0.1,
        claim_batch=4,
    )
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        await asyncio.sleep(0)

    pub = Publisher()
    core = MockTrainingHook(
        settings,
        cell_id="c0",
        index=0,
        target="x:1",
        source=sources[0],
        batches=batches,
        publisher=pub,
        sleep=sleep,
    )
    sat = MockTrainingHook(
        settings,
        cell_id="c1",
        index=1,
        target="x:2",
        source=sources[1],
        batches=batches,
        sleep=sleep,
    )
    cmd = JoinBatch(epoch=1, batch_id=1, policy_version=0, prefix_size=2, core_target="x:1")
    assert await core.join_batch(cmd)
    assert await sat.join_batch(cmd)
    assert await core.join_batch(cmd)  # idempotent
    await asyncio.gather(core.wait_batch(1), sat.wait_batch(1))
    assert sorted(packer.claimed_by(1)) == [f"m{i}" for i in range(6)]
    assert packer.batch_status(1).acked == 6
    assert core.micro_steps + sat.micro_steps == 6
    assert sum(src.calls for src in sources) < 6  # several micro-steps per claim call
    assert core.trained_tokens + sat.trained_tokens == 600
    assert pub.published == [(1, 1)]
    assert core.version == 1 and core.last_batch_id == 1
    per_step = 100 * 6 * 1e9 / (1e12 * 0.5) * 0.001
    assert slept.count(pytest.approx(per_step)) == 6
    assert pytest.approx(2.0 * 0.001) in slept  # the optimizer's fixed cost
    # The core refuses a batch naming a version it does not hold.
    assert not await core.join_batch(JoinBatch(1, 2, 5, 1, ""))
    assert core.store.newest == 1


def test_marker_counts_each_turn_from_its_new_segment() -> None:
    def seq(ids: list[int]) -> Sequence:
        n = len(ids)
        return Sequence(token_ids=tuple(ids), loss_mask=(0,) * n, logprobs=(0.0,) * n, advantage=0.0)

    turn0 = [2, 5, 5, 5, 9, 9]  # marker + 3 prompt tokens, 2 output tokens
    turn1 = turn0 + [2, 6, 6, 9, 9, 9]  # the old context, a new segment of 3, 3 output tokens
    step = MicroStep("m", 1, (seq(turn0), seq(turn1)))
    assert sequence_tokens(step, 2) == len(turn1)  # the final context, once
    assert sequence_tokens(step, -1) == len(turn0) + len(turn1)


def test_build_hook_picks_mock_for_mode_mock(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GYRE_CONFIG", raising=False)
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(
        "cell_agent: {training: {mode: mock, packer_target: '127.0.0.1:1', time_scale: 0.5}}\n"
    )
    rt = types.SimpleNamespace(target="127.0.0.1:2", etcd=None, keys=None)
    cfg = config_mod.load(CellAgentConfig, cfgfile, cell_id="cell-0", index=0, policy_version=3)
    got = hook_mod.build_hook(rt, cfg)
    assert isinstance(got, MockTrainingHook)
    assert got.settings.time_scale == 0.5 and got.settings.initial_policy_version == 3
    standalone = config_mod.load(CellAgentConfig, cfgfile, cell_id="s", kind="standalone", index=-1)
    assert not isinstance(hook_mod.build_hook(rt, standalone), MockTrainingHook)
