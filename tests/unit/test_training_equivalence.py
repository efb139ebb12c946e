"""Equivalence, the core promise of streaming elastic training: on the same batches, the
update taken with 1 cell equals the update taken with 2 and 3 cells whose satellites join
at different micro-steps (float64, tight tolerance), on the core and on every satellite;
a satellite that cannot hold the batch's version (its snapshot pull fails) trains nothing
and its gradient never enters, so the update is still exact; and the check is sensitive
(a batch missing one micro-step gives different parameters)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from gyre.errors import NotFound
from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.controller import ControllerParams, TrainingController
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.training_fakes import (
    TOL,
    FakeSource,
    InProcessCollective,
    InProcessMembership,
    RecordingPublisher,
    tiny_lm,
)

MICRO_STEPS = 8
OPT = OptimConfig(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)


def _batches():
    return {b: synthetic_batch(b, MICRO_STEPS, seed=3) for b in (1, 2)}


class Cluster:
    """k controllers in one process sharing a fake packer, membership and collectives."""

    def __init__(self, k: int, base_model, batches, fail_pull: frozenset[int] = frozenset()) -> None:
        self.fail_pull = fail_pull
        self.packer = FakePacker()
        self.membership = InProcessMembership()
        self.collective = InProcessCollective()
        self.publisher = RecordingPublisher()
        self.batches = batches
        self.snapshots = [SnapshotStore(keep=2) for _ in range(k)]
        self.cells: list[TrainingController] = []
        for i in range(k):
            # Satellites start from other weights: they must pull the core's snapshot.
            model = copy.deepcopy(base_model) if i == 0 else tiny_lm(seed=100 + i)
            trainer = Trainer(model, version=1 if i == 0 else 0)
            self.cells.append(
                TrainingController(
                    cell_id=f"c{i}",
                    index=i,
                    trainer=trainer,
                    snapshots=self.snapshots[i],
                    source=FakeSource(self.packer, f"c{i}"),
                    membership=self.membership,
                    collective=self.collective.for_rank(i),
                    publisher=self.publisher if i == 0 else None,
                    puller=self._failing_pull if i in fail_pull else self._pull,
                    core=CoreOptimizer(trainer, OPT) if i == 0 else None,
                    params=ControllerParams(claim_wait_s=0.05, join_wait_s=5.0, collective_timeout_s=60),
                )
            )

    async def _pull(self, target: str, version: int):
        assert target == "core"
        snap = self.snapshots[0].get(version)
        return snap.version, snap.state_dict()

    async def _failing_pull(self, target: str, version: int):
        raise NotFound(f"snapshot version {version} is not kept")

    async def run_batch(self, batch_id: int, version: int, join_after: list[int]) -> None:
        """Satellite i joins once the packer handed out join_after[i-1] micro-steps."""
        steps = self.batches[batch_id]
        first = max([1, *join_after])
        self.packer.add_batch(batch_id, version, steps, released=first)
        assert await self.cells[0].join_batch(batch_id, version, 1, "core")
        assert await self.cells[0].join_batch(batch_id, version, 1, "core")  # redelivered: idempotent
        for i, after in enumerate(join_after, start=1):
            await asyncio.to_thread(self.packer.wait_claimed, batch_id, after)
            assert await self.cells[i].join_batch(batch_id, version, i + 1, "core")
            self.packer.release(batch_id, 2)
        self.packer.release(batch_id)
        outs = await asyncio.wait_for(
            asyncio.gather(*(c.wait_batch(batch_id) for c in self.cells[: 1 + len(join_after)])), 120
        )
        assert outs[0].prefix_size == 1 + len(join_after)
        assert sum(o.local_micro_steps for o in outs) == len(steps)
        assert outs[0].total_tokens == sum(s.num_tokens for s in steps)
        assert all(o.new_version == version + 1 for o in outs)
        return outs


def _params(c: TrainingController) -> torch.Tensor:
    return c.trainer.flat_params().clone()


@pytest.fixture(scope="module")
def base_model():
    return tiny_lm(seed=0)


@pytest.fixture(scope="module")
def reference(base_model):
    async def run():
        cl = Cluster(1, base_model, _batches())
        await cl.run_batch(1, 1, [])
        await cl.run_batch(2, 2, [])
        assert cl.publisher.published == [(2, 1), (3, 2)]
        return _params(cl.cells[0]), cl.publisher.diagnostics

    return asyncio.run(run())


@pytest.mark.parametrize(
    "joins",
    [
        pytest.param([[2], [0]], id="2cells-s1-after-2-then-from-start"),
        pytest.param([[1, 5], [3, 4]], id="3cells-staggered"),
    ],
)
async def test_k_cells_equal_one_cell(base_model, reference, joins):
    reference, diagnostics = reference
    k = 1 + len(joins[0])
    cl = Cluster(k, base_model, _batches())
    await cl.run_batch(1, 1, joins[0])
    await cl.run_batch(2, 2, joins[1])
    for cell in cl.cells:
        got = _params(cell)
        assert cell.version == 3
        assert torch.allclose(got, reference, rtol=0, atol=TOL), (cell.cell_id, (got - reference).abs().max())
    # The loss diagnostics cover every participant's tokens: the same as one cell's.
    for version, want in diagnostics.items():
        got = cl.publisher.diagnostics[version]
        assert want["tokens"] > 0 and got["tokens"] == want["tokens"]
        for name in (
            "behaviour_weight_mean",
            "behaviour_weight_max",
            "entropy",
            "clip_fraction",
            "grad_norm",
        ):
            assert got[name] == pytest.approx(want[name], rel=1e-9), name
        assert got["lag_hist"] == want["lag_hist"]
    # Satellites did train part of the batch (the test is not 1-cell in disguise).
    for b in (1, 2):
        owners = set(cl.packer.claimed_by(b).values())
        assert len(owners) >= 2, owners


async def test_satellite_without_the_version_contributes_nothing(base_model, reference):
    reference, _ = reference
    cl = Cluster(3, base_model, _batches(), fail_pull=frozenset({2}))
    outs = await cl.run_batch(1, 1, [1, 2])
    assert outs[2].stale and outs[2].local_micro_steps == 0 and outs[0].stale_participants == 1
    assert "c2" not in set(cl.packer.claimed_by(1).values())
    # After the broadcast it holds the new version and takes part normally.
    outs = await cl.run_batch(2, 2, [1, 2])
    assert not outs[2].stale
    for cell in cl.cells:
        assert torch.allclose(_params(cell), reference, rtol=0, atol=TOL)


async def test_the_check_is_sensitive(base_model, reference):
    reference, _ = reference
    batches = _batches()
    batches[1] = batches[1][:-1]  # one micro-step missing
    cl = Cluster(1, base_model, batches)
    await cl.run_batch(1, 1, [])
    await cl.run_batch(2, 2, [])
    assert (_params(cl.cells[0]) - reference).abs().max() > 1e3 * TOL
    assert (_params(cl.cells[0]) - base_model_flat(base_model)).abs().max() > 1e-4


def base_model_flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
