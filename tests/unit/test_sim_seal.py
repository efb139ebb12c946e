"""Sealing a drained burst's batch (the policy's SealBatch): the batch closes with the
groups already claimed plus the ready ones, exactly one update follows, and an empty batch
is never sealed."""

from __future__ import annotations

from sim.cluster import Cluster, Group
from sim.config import CostConfig
from sim.events import EventLoop


def _cluster(batch_groups: int) -> tuple[Cluster, list[int]]:
    loop = EventLoop()
    cl = Cluster(
        loop=loop,
        cost_cfg=CostConfig(weight_sync_s=0.0),
        cells=2,
        standalone=0,
        slots=4,
        batch_groups=batch_groups,
        max_staleness=1,
    )
    updates: list[int] = []
    cl.on_boundary = lambda: None
    cl.on_update = updates.append
    return cl, updates


def _ready(cl: Cluster, n: int, tokens: int = 10_000) -> None:
    for i in range(n):
        g = Group(len(cl.groups), i, 1, 0, 1, closed=1, tokens=tokens, ready_s=0.0)
        cl.groups.append(g)
        cl.trainer.pool.append(g)


def test_seal_closes_the_batch_with_claimed_and_ready_groups() -> None:
    cl, updates = _cluster(batch_groups=5)
    _ready(cl, 2)
    cl.move_to_training(cl.cells[0])
    cl.loop.run(until=60.0)
    tr = cl.trainer
    assert tr.consumed_groups == 2 and tr.needs == 3 and updates == []  # waits for 3 more
    _ready(cl, 1)
    cl._trainer_kick()
    assert cl.seal_batch(tr.batch_id)  # drained: 2 claimed + 1 ready is the whole batch
    assert tr.needs <= 1
    cl.loop.run(until=200.0)
    assert updates == [1] and tr.consumed_groups == 3
    # The next batch is empty: sealing it would make an update out of nothing.
    assert not cl.seal_batch(tr.batch_id)
    assert not cl.seal_batch(tr.batch_id - 1)  # a stale batch id changes nothing
    cl.loop.run(until=400.0)
    assert updates == [1]


def test_seal_is_a_no_op_when_ready_groups_fill_the_batch() -> None:
    cl, updates = _cluster(batch_groups=3)
    _ready(cl, 5)
    assert not cl.seal_batch(cl.trainer.batch_id)
    cl.move_to_training(cl.cells[0])
    cl.loop.run(until=300.0)
    assert updates == [1] and cl.trainer.consumed_groups >= 3
