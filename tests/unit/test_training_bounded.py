"""A training cell runs for days in bounded memory (issue 36: the core's RSS grew for as
long as it trained).

- The controller keeps the task and outcome of its newest ``keep_batches`` batches only;
  before, every batch's task, outcome and diagnostics stayed for the life of the process.
  A redelivered JoinBatch of a kept batch is still idempotent; one of a forgotten batch
  answers not joined and starts nothing.
- A failed attempt leaves no claim times behind (they stayed, one per micro-step claimed).
- After each batch the cell hands the heap it freed back to the system
  (:func:`gyre.heap.release_free_heap`): glibc kept it resident, and the core's RSS crept
  up while its live heap stayed flat. In a subprocess, memory freed in holes between live
  blocks of a worker thread's arena stays resident until it is released.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys

import pytest

from gyre import heap
from gyre.errors import FailedPrecondition
from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.controller import BatchOutcome, ControllerParams, TrainingController
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.training_fakes import (
    FakeSource,
    InProcessCollective,
    InProcessMembership,
    RecordingPublisher,
    tiny_lm,
)

VOCAB = 64


class _AckFailsOnce(FakeSource):
    """The packer refuses the first ack of batch ``fail``: that attempt fails after claiming."""

    def __init__(self, packer: FakePacker, cell_id: str, fail: int) -> None:
        super().__init__(packer, cell_id)
        self.fail = fail

    async def ack_many(self, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        if batch_id == self.fail:
            self.fail = 0
            raise FailedPrecondition("the packer refuses this ack")
        return await super().ack_many(batch_id, micro_step_ids)


def _core(keep: int = 8, fail: int = 0) -> tuple[TrainingController, FakePacker]:
    packer = FakePacker()
    trainer = Trainer(tiny_lm(seed=2, vocab=VOCAB, hidden=16), version=1)
    ctl = TrainingController(
        cell_id="c0",
        index=0,
        trainer=trainer,
        snapshots=SnapshotStore(keep=2),
        source=_AckFailsOnce(packer, "c0", fail),
        membership=InProcessMembership(),
        collective=InProcessCollective().for_rank(0),
        publisher=RecordingPublisher(),
        puller=None,  # type: ignore[arg-type]  # the core never pulls
        core=CoreOptimizer(trainer, OptimConfig(lr=1e-3)),
        params=ControllerParams(claim_wait_s=0.05, keep_batches=keep),
    )
    return ctl, packer


async def _train(ctl: TrainingController, packer: FakePacker, batch_id: int, micro_steps: int = 1):
    version = ctl.version
    packer.add_batch(
        batch_id, version, synthetic_batch(batch_id, micro_steps, seqs_per_step=1, vocab=VOCAB, max_len=8)
    )
    assert await ctl.join_batch(batch_id, version, 1, "")
    return await asyncio.wait_for(ctl.wait_batch(batch_id), 30)


def _outcomes_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is BatchOutcome)


async def test_after_200_batches_the_core_keeps_the_newest_few():
    ctl, packer = _core(keep=8)
    before = _outcomes_alive()
    for b in range(1, 201):
        await _train(ctl, packer, b)
    assert ctl.status()["last_batch_id"] == 200
    assert sorted(ctl.book.tasks) == list(range(193, 201))
    assert sorted(ctl.book.outcomes) == list(range(193, 201))
    assert _outcomes_alive() - before <= 8  # nothing else holds an old batch's outcome
    # A redelivered JoinBatch of a kept batch is idempotent; a forgotten one starts nothing.
    assert await ctl.join_batch(200, ctl.version, 1, "")
    assert not await ctl.join_batch(5, 1, 1, "")
    assert 5 not in ctl.book.tasks and len(ctl.book.tasks) == 8


async def test_a_failed_attempt_leaves_no_claim_times_behind():
    ctl, packer = _core(fail=1)
    version = ctl.version
    packer.add_batch(1, version, synthetic_batch(1, 6, seqs_per_step=1, vocab=VOCAB, max_len=8))
    assert await ctl.join_batch(1, version, 1, "")
    with pytest.raises(FailedPrecondition):
        await asyncio.wait_for(ctl.wait_batch(1), 30)
    assert ctl.claims.claimed_at == {}
    # The next attempt gets every micro-step back and trains them all.
    assert await ctl.join_batch(1, version, 1, "")
    out = await asyncio.wait_for(ctl.wait_batch(1), 30)
    assert out.applied and out.local_micro_steps == 6 and ctl.claims.claimed_at == {}


async def test_each_batch_hands_the_freed_heap_back(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heap, "release_free_heap", lambda: calls.append(1) or True)
    ctl, packer = _core()
    for b in range(1, 6):
        await _train(ctl, packer, b, micro_steps=2)
    assert len(calls) == 5
    ctl.params = ControllerParams(claim_wait_s=0.05, release_heap=False)
    await _train(ctl, packer, 6)
    assert len(calls) == 5


_PROBE = """
import json, threading
from gyre.heap import release_free_heap

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

kept = []
def churn():
    # 100 MB in blocks under the mmap threshold, from a worker thread's arena; one block in
    # ten stays alive, so the free ones are holes the allocator cannot trim from the top.
    blocks = [bytearray(100_000) for _ in range(1000)]
    kept.extend(blocks[::10])

t = threading.Thread(target=churn)
t.start()
t.join()
freed = rss_mb()
released = release_free_heap()
print(json.dumps({"freed": freed, "after": rss_mb(), "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_free_heap_returns_freed_holes_to_the_system():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if heap._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim here")
    assert got["released"]
    assert got["freed"] - got["after"] > 50, got  # ~90 MB freed in holes, back to the system
