"""Gyre's rollout capacity in KV (issue 33): a cell counts as the executions its KV cache
keeps at the measured mean context, on ``kv_fill`` of that cache, and dispatch is cut to
that capacity while recomputing evicted prefixes takes a share of rollout's time."""

from __future__ import annotations

import pytest

from services.scheduler.policy import (
    CellState,
    CellView,
    DispatchBurst,
    GyreConfig,
    GyrePolicy,
    MoveToTraining,
    Pipeline,
    Snapshot,
)
from services.scheduler.policy.gyre import rollout_capacity
from testkit.policy_rig import cells as _cells
from testkit.policy_rig import heavy_pipeline as _heavy_pipeline
from testkit.policy_rig import snap as _snap


def _moved(policy: GyrePolicy, snap: Snapshot) -> list[str]:
    """The cells one decision moves to training."""
    return [a.cell_id for a in policy.decide(snap) if isinstance(a, MoveToTraining)]


def _capacity_seen(snap: Snapshot, config: GyreConfig | None = None) -> int:
    """The rollout capacity the policy's target compared W_eta with in one decision."""
    seen = []

    class Spy(GyrePolicy):
        def target(self, snap, elastic, w):
            seen.append(rollout_capacity(snap.cells, snap.pipeline))
            return super().target(snap, elastic, w)

    Spy(config).decide(snap)
    return seen[-1]


def test_gyre_counts_rollout_capacity_in_executions_the_kv_keeps_resident():
    # A64 (seed 1): 48 slots a cell, but agents of ~50k tokens of context at the median, of
    # which one cell's KV (1.88 M tokens) keeps ~37. Counted in slots, moves and lending packed
    # the agents left in rollout beyond what the KV holds; every turn of an evicted agent
    # prefilled its whole context again (18,829 GPU-s of recompute in the 8,590 s run; 4,438
    # in 7,824 s counted in KV). Here: 10 slots, but 1e5 KV tokens over a mean context of 5e4
    # keep 2 executions a cell (counted on all of it: kv_fill 1); W_eta 16.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    kv = {"kv_tokens_per_cell": 1e5, "context_tokens": 5e4}
    p = _heavy_pipeline(16, **kv)
    assert p.kv_slots(10) == 2 and _heavy_pipeline(16).kv_slots(10) == 10
    # The rate target (3) asks for a third training cell: in slots the 7 rollout cells left
    # hold 70 >= 16; in what their KV keeps, 14 < 16, so c2 stays in rollout.
    cells = _cells([T] * 2 + [R] * 8)
    assert _moved(GyrePolicy(GyreConfig(kv=False)), _snap(cells, p)) == ["c2"]
    whole = GyrePolicy(GyreConfig(kv_fill=1.0))
    assert not _moved(whole, _snap(cells, p))
    # Lending likewise: the spare cells of the slot count are not spare in KV.
    busy = _heavy_pipeline(12, ready_groups=10, ready_tokens=5e5, batch_assigned=5, backlog_tokens=1e5, **kv)
    cells = _cells([T] * 5 + [R] * 5)
    assert _moved(GyrePolicy(GyreConfig(kv=False)), _snap(cells, busy)) == ["c5"]
    assert not _moved(whole, _snap(cells, busy))
    # Unmeasured (no context yet, or no KV size known): slots, as before.
    assert Pipeline(max_staleness=1, group_size=4, batch_groups=2, kv_tokens_per_cell=1e5).kv_slots(10) == 10


def test_gyre_counts_on_a_share_of_each_cells_kv():
    """A64 with drift, open executions at the rollout KV's capacity counted on all of it:
    recomputing evicted prefixes still took 60% of rollout's time (contexts grow as agents
    decode, and placement balances executions, not tokens, so cells holding longer agents
    than the mean evict). Counted on kv_fill (0.6) of it, seeds 1-4 ran 19,348 / 20,288 /
    20,019 / 24,571 s instead of 19,330 / 34,856 / 25,893 / 26,723 s."""
    p = Pipeline(max_staleness=1, group_size=4, batch_groups=20, kv_tokens_per_cell=1e5, context_tokens=1e4)
    cells = _cells([CellState.TRAINING] + [CellState.ROLLOUT] * 4, slots=48)
    s = _snap(cells, p)
    assert _capacity_seen(s) == 4 * 6  # 0.6 x 1e5 / 1e4 = 6 a cell
    assert _capacity_seen(s, GyreConfig(kv_fill=1.0)) == 4 * 10  # all of it: 10
    with pytest.raises(ValueError):
        GyreConfig(kv_fill=0.0)


def test_gyre_keeps_its_kv_headroom_once_recompute_has_taken_rollout_time():
    """The headroom costs a run whose contexts hold still: A64 (seeds 1-2) ran 8,211 / 8,221 s
    counted on 0.6 of the KV and 7,748 / 7,744 s on all of it, its recompute never above 3%
    of rollout's time. A64 with drift crossed 5% 3,000-4,100 s in. So the capacity counts on
    the whole KV until recompute's share of rollout time first reaches kv_headroom_after
    (5%), and on kv_fill from then on, even when the share falls again; where recompute is
    not measured (the live scheduler), on kv_fill from the start, as before."""
    cells = _cells([CellState.TRAINING] + [CellState.ROLLOUT] * 4, slots=48)

    def capacity(peak: float | None, share: float = 0.0, config: GyreConfig | None = None) -> int:
        p = Pipeline(
            max_staleness=1,
            group_size=4,
            batch_groups=20,
            kv_tokens_per_cell=1e5,
            context_tokens=1e4,
            kv_recompute_share=share,
            kv_recompute_peak=peak,
        )
        return _capacity_seen(_snap(cells, p), config)

    assert capacity(None) == 4 * 6  # not measured: 0.6 x 1e5 / 1e4 = 6 a cell
    assert capacity(0.0) == capacity(0.03, share=0.03) == 4 * 10  # calm: the whole KV
    assert capacity(0.05, share=0.05) == 4 * 6  # recompute reached 5%: headroom
    assert capacity(0.3, share=0.0) == 4 * 6  # and kept once the share falls again
    assert capacity(0.0, config=GyreConfig(kv_headroom_after=0.0)) == 4 * 6  # 0: always
    with pytest.raises(ValueError):
        GyreConfig(kv_headroom_after=1.5)


def test_gyre_cuts_dispatch_to_the_rollout_kv_while_recompute_takes_rollout_time():
    # A64 with drift (seeds 1-2): contexts grow 2.6x over the run, and the gate let ~2,500
    # agents out where the rollout cells' KV kept ~1,500; every agent beyond it evicted the
    # cached prefixes of others waiting on tools (0.6-0.8 M GPU-s of recompute). While
    # recomputing takes kv_cut_share (10%) of the rollout cells' time, dispatch is cut to
    # what their KV keeps: 31,369 / 35,136 -> 27,793 / 26,556 s. Where recompute is cheap
    # (short contexts) the cut stays off: cut always, the small KV-bound scenario ran 1.8x
    # slower. Here 8 rollout cells keep 2 executions each (16: the kv_fill share of their KV
    # the capacity counts on is 1e5 tokens, contexts are 5e4) and 12 are open.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    kv = {"kv_tokens_per_cell": 1e5 / GyreConfig.kv_fill, "context_tokens": 5e4}
    cells = _cells([T] * 2 + [R] * 8)

    def dispatched(p: Pipeline, config: GyreConfig | None = None, cells: tuple[CellView, ...] = cells) -> int:
        acts = GyrePolicy(config).decide(_snap(cells, p, quota=400))
        return sum(a.quota for a in acts if isinstance(a, DispatchBurst))

    gate = dispatched(_heavy_pipeline(12, **kv))  # recompute not measured: the gate's room
    assert gate > 4
    thrashing = _heavy_pipeline(12, kv_recompute_share=0.3, **kv)
    assert dispatched(thrashing) == 4  # one group of 4 fits the 16 the KV keeps
    assert dispatched(_heavy_pipeline(12, kv_recompute_share=0.05, **kv)) == gate  # cheap: no cut
    assert dispatched(thrashing, GyreConfig(kv=False)) == gate
    assert dispatched(thrashing, GyreConfig(kv_cut_share=1.0)) == gate  # 1: off
    # Full: nothing goes out until executions close; with nothing open, one group always does.
    assert dispatched(_heavy_pipeline(16, kv_recompute_share=0.3, **kv)) == 0
    one = _cells([T] * 9 + [R])  # one rollout cell keeping 2: less than a group
    assert dispatched(_heavy_pipeline(0, kv_recompute_share=0.3, **kv), cells=one) == 4
