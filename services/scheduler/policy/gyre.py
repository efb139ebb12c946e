"""Gyre's elastic policy ("gyre", the default): overlapping bursts under the staleness
bound, cells sized from rates, committed work always covered, tail control.

Dispatch. Like the asynchronous baselines, groups go out whenever the staleness gate
``(v + eta + 1) x B + X`` has room (:func:`.common.dispatch_to_gate`), stamped with the
version they serve; unconsumable groups are cancelled early by the mechanism
(:mod:`.staleness`), the same rule for every policy. Gyre differs in where cells are, and in
one cut: while recomputing evicted prefixes takes a share of rollout's time, it dispatches no
more than the rollout cells' KV keeps ("Capacity in KV" below).

Roles, from rates (not thresholds). With ``r`` the training rate of one cell, ``g`` the
tokens per ready group and ``lambda`` the arrival rate of ready groups, both measured over
``rate_window_s`` (600 s by default: about one update), the trainer must keep up with the
arrivals and drain its queue (the backlog of the batch in progress plus every ready group,
this batch's and the next's) within the horizon ``H`` (``min_horizon_s``, 300 s)::

    T_rate = ceil((lambda x g + (backlog + ready x g) / H) / r)

The first version sized the prefix so that the batch's last micro-step would finish as its
last group arrived (``work / (r x max(missing / lambda, 30 s))``). Measured on B64 and A64
that rule surged to 50+ training cells whenever a dispatch wave of ready groups landed near
the end of a batch (the work of the next batch counted against a 30 s horizon), starved
rollout down to a few cells holding every open execution, and oscillated by 20 cells every
update: every swing paid reroutes, and a cell returned to rollout stays empty until the next
dispatch (the staleness gate, not the slots, bounds the open work), so Gyre lost 7-13% to
the best fixed split. The training side only needs to keep up with the arrival rate: the
last group of a batch takes seconds to train at any T, so a surge buys nothing at the end
of a batch. The target is capped so that rollout keeps the committed work covered::

    T_max = elastic cells - ceil(W_eta / slots)        (W_eta: staleness.waterlevel)

and the rest of the cells are lent to rollout. The cap only stops moves: a cell returns
because the rate target fell, never because W_eta rose. W_eta jumps by up to ``B x g``
executions at every publication (the new batch v + eta enters the window); at eta >= 2 on
profile A that exceeds the slots of every cell, and a cap that also forced returns sent
~18 cells back at each publication and moved them to training again one by one (A64,
eta = 4, 3 updates: 2,060 s; returns from the uncapped target: 1,781 s; the fixed T = 20
split: 1,809 s). At eta <= 1 the two rules ran identically on A64 and B64. The executions
W_eta counts beyond the capacity wait for a slot: they serve later batches.

**Saturated rollout: a share of the target.** When W_eta exceeds the slots of the cells
the target would leave to rollout (``W_eta > slots x (elastic - T_rate)``: executions wait
for a slot, which happens at eta >= 2, where W_eta counts eta + 1 batches of work), rollout
is the bottleneck and every cell it keeps turns directly into ready groups, while the
pool of ready groups (up to eta batches ahead) feeds the trainer between dispatch waves.
The prefix is then sized to ``saturated_share`` (0.6) of ``T_rate``. Measured on B64 at
eta = 4 (seeds 1-2, 10 updates): the full target kept the trainer idle 22-24% and ran
1,827-1,841 s; shares 0.9 / 0.8 / 0.7 / 0.6 / 0.5 of it ran 1,822 / 1,801-1,805 /
1,783-1,793 / 1,772-1,778 / 1,784-1,797 s (trainer idle 18 / 15 / 9 / 3 / 0%). The same
shares applied everywhere cost B64 at eta = 1 up to 6% (0.6: 2,537 s against 2,386 s) and
A64 2-6%, where rollout is latency-bound and the trainer must absorb each dispatch wave;
the saturation condition never holds there, so those runs are unchanged.

**The supply gate disappears into this rule**:
"enough ready supply, held for an interval" was a proxy for "training would not starve";
the rate rule states that directly (no supply -> no work -> T = 1) and reacts within one
decision instead of after ``interval_s``, and it never sends a cell to train on a batch that
the arrival rate cannot feed.

Hysteresis. A cell moves to training when ``T < target`` (core first, the prefix grows by
index, up to ``parallel_moves`` of the elastic cells in flight: "Moves in flight" below); a
satellite returns only when ``T > T_rate + h`` with ``h = max(1, ceil(hysteresis x
T_rate))`` (``T_rate`` uncapped, see above, and before the saturated share: a band measured
against the share was narrower, and satellites went back and forth as saturation came and
went; B64 at eta = 4, seeds 1-3: switch + reroute GPU-seconds 2.1% -> 1.7-1.9%, 1,772 ->
1,765 s median; A64 at eta = 2: 5,322 -> 5,265 s; eta <= 1 never saturates and is
unchanged). Nothing happens at an update: satellites stay across updates whenever the next
batch's supply keeps the target up (there is no burst end any more).

Invariant (tested with hypothesis): a move to training never leaves rollout capacity below
``W_eta`` (except a breathing core coming back to ``breathe_in`` x B ready groups); the core
leaves only to breathe; the training set is a prefix of the elastic cells; at most
``max_moves`` moves to training are in flight; no dispatch exceeds the gate.

Moves in flight. Up to ``parallel_moves`` (1/32) of the elastic cells move to training at
once, the next ones by index, each checked with the capacity and free slots the earlier moves
of the decision leave. One at a time, the prefix grew a cell per switch: at 1,024 cells
(B1024, one update) it needed ~1,400 s to reach the 512 cells the arrivals asked for, and
Gyre took 503 s where the T = 512 split took 283 s; 32 in flight: 287 s. Below 64 elastic
cells this is one move at a time, as before; at 64 two (seeds 1-2: A64, B64, B64 at eta 0
and B64 with drift within 1% either way; A64 with drift, a chaotic scenario, moved from
27,793 / 26,556 s to 19,330 / 34,856 s).

Breathing (``breathe``, on by default), once a training rate has been measured:

* Lending, at any rate target: while there is work a joining cell could claim (ready groups,
  or a batch in progress waiting for its stragglers' groups; not the optimizer step alone)
  worth ``lend_min_s`` of training to it, and W_eta is above 0, every cell W_eta leaves idle
  beyond the rate target is lent to training, but only once it is empty: PlanMoves keeps new
  work off it meanwhile. Not while rollout is saturated (W_eta leaves no cell beyond the
  rate target: lending would undo the saturated share; B64 at eta 4 lost 6% when it did).
  For a light trainer (rate target 1) a lent cell goes back as soon as W_eta exceeds the
  rollout capacity (no hysteresis: it was there only because rollout could spare it) and
  stays while rollout could not use it (it flapped out and in as ready groups came and were
  claimed). Above, a cell beyond the rate target goes back once nothing is left to claim;
  W_eta's jumps are the rate rule's and its band's to answer. Measured (seed 1): the rate
  rule alone kept 5-15 empty rollout cells idle while ready groups piled up at the end of
  each batch; lending ran B64 2,485 -> 2,349 s and B64 at eta 0 3,504 -> 3,287 s (seed 2:
  2,549 -> 2,351 and 3,537 -> 3,314), A64 8,865 -> 8,640 s and 8,717 -> 8,712, B64 at eta 2
  2,047 -> 2,033 and at eta 4 1,787 -> 1,810 s. Lending busy cells rerouted their
  executions: at any rate target B64 at eta 0 took 17,188 s instead of 3,659 s (1,140
  switches instead of 164; docs/history.md); for a light trainer it cost A64 4%.
* The core, for a light trainer only, rolls out while the trainer has nothing to do (no
  batch in progress, fewer than ``breathe_in`` x B groups ready) and W_eta exceeds what
  rollout holds without it by ``breathe_out`` of its slots; it comes back once
  ``breathe_in`` x B groups are ready, even if W_eta is not covered then (the trainer is the
  pipeline's next step: the gate waits for its version). W_eta counts the decision's own
  dispatch, so at a publication the core leaves before the control loop joins it to the
  next batch. Above a rate target of 1 the core's work is continuous.

Capacity in KV (``kv``, on by default). Every comparison of rollout capacity with W_eta
above (the cap, lending, returns, breathing out) counts a cell as the executions its KV cache
keeps resident at the measured mean context (``Pipeline.kv_slots``), where that is fewer than
its slots. An agent waiting on a tool keeps its prefix cached; beyond what the KV holds,
prefixes are evicted and every turn of an evicted agent prefills its whole context again.
Measured on A64 (cells of 48 slots; a mean context of ~50k tokens, 29k-68k over the run,
so the KV keeps 24-48 agents, 37 at the median): in slots, moves and lending packed the
agents left in rollout past the KV and 3-4% of the GPU time went to recomputing prefixes
(18,829 / 22,981 GPU-s; in KV 4,438 / 1,541); seeds 1-2 ran 8,590 / 8,720 -> 7,824 / 7,746
s. The live scheduler fills both: ``kv_tokens_per_cell`` is the smallest KV the elastic
engines registered (vLLM: the blocks its core allocated times the block size), and
``context_tokens`` the packer's mean open context (each open execution's latest turn).
Where either is unknown (0) the policy counts slots.

The capacity counts on ``kv_fill`` (0.6) of each cell's KV, not all of it. With the open
executions at the KV's whole capacity, A64 with drift still spent ~60% of its rollout
time recomputing evicted prefixes: contexts grow as agents decode, and placement balances
executions, not tokens, so the cells holding longer agents than the mean evict. Seeds 1-4
(time to 10 updates, s):

    kv_fill     A64 with drift                    A64 (seeds 1-2)
    1.0         19,330  34,856  25,893  26,723    7,706  7,744
    0.8         22,770  24,391  25,298  21,635    7,936  7,911
    0.7         26,212  18,986  25,159  29,575    8,017  8,002
    0.6         19,348  20,288  20,019  24,571    8,211  8,221

The drifting runs are chaotic (a run's recompute feeds on itself), so one seed says
little; the mean over four fell from 26,700 to 21,100 s. A64, which recomputes little,
paid 6% for it (its trainer gets fewer cells). Applied only while the recompute share is
high (the cut's gate), the headroom came too late: 20,547 / 28,927 s on seeds 1-2.

So the headroom waits for recompute to show (``kv_headroom_after``, 5%): the capacity
counts on the whole KV until recomputing evicted prefixes first takes 5% of the rollout
cells' time (``Pipeline.kv_recompute_peak``, the highest share of the run), and on
``kv_fill`` from then on, even when the share falls again (gated on the current share
instead, it came too late: above). A64 never reached 3% counted on the whole KV; A64
with drift crossed 5% 3,000-4,100 s into its runs. Seeds 1-4 (time to 10 updates, s):

    headroom            A64 with drift                    A64 (seeds 1-2)   B64 with drift (1-2)
    always (0.6)        19,348  20,288  20,019  24,571    8,211  8,221      3,282  3,399
    after 5% (0.6)      18,004  17,997  18,369  19,610    7,748  7,744      3,247  3,338
    after 3% (0.6)      23,838  17,997       -       -        -      -          -      -

Where recompute is not measured (the peak is None: the live scheduler, whose engines do
not report their recomputed prefill yet) the headroom applies from the start.

Dispatch is cut to what the rollout cells' KV keeps (the open executions stay within
``rollout_capacity``; with nothing open one group always goes out) while recomputing
evicted prefixes takes at least ``kv_cut_share`` (10%) of the rollout cells' time
(``Pipeline.kv_recompute_share``). Under drift (A64 with contexts growing 2.6x over the run)
the gate let ~2,500 agents out where the KV kept ~1,500: seeds 1-2 ran 31,369 / 35,136 ->
27,793 / 26,556 s (the T = 16 split, whose slow trainer throttles its own dispatch: 22,251 /
22,291 s). Cut whenever the KV binds, the small KV-bound test scenario (engines of 6,000
tokens, short contexts) ran 1.8x slower: there recomputing is cheap and the concurrency the
cut takes away is not. Measured over 600 s the share engaged and released the cut as the
recompute came and went (A64-drift 34,980 s); the simulator measures it over 1,800 s. The
live scheduler does not measure it yet (it needs the engines' recomputed prefill), so live
the cut never engages.

A lent cell (beyond the rate target) stays while work is left to claim and rollout does not
need its slots, even when what is left is below the lending bar: returned on the bar, the
cells of A64 with drift went back as they trained the claimable work down and were lent
again as the next groups arrived (3,147 lends, 2,993 returns in one run).

No cell moves to training while its executions have no free slots on the other rollout
cells: the live drain calls such a move off (the simulator let them wait homeless, which
made its small loaded scenario 5% faster than the live system could be).

The wave waits (``wave_waits``, on by default). A dispatch of at least half a batch (a
publication's wave) holds while elastic cells are on their way back to rollout. Lent cells go
back as the batch's last groups are claimed, a couple of seconds before its publication; when
waking takes longer than that, the wave went out to the cells already in rollout (placement
spreads over the cells it sees), the returning cells came up with nothing to run, and nothing
moves work onto them afterwards: the batch's tail ran on fewer, fuller cells. With the
simulator's switch costs x5 (a return of 7.5 s), B64 seeds 1-2 ran 2,503 / 2,505 ->
2,417 / 2,444 s and B64 with drift (seed 1) 3,545 -> 3,381 s. A trickle (groups refilling the
gate as others close) is not held.

Tail control. ``PlanMoves`` names the next cells the target will take (plus
``plan_ahead``); placement launches nothing new on them while other cells have room, and
spreads everything else (least loaded first), so planned cells empty by themselves before
they move and nothing else is packed. ``Migrate`` moves an execution of the oldest
consumable version (the tail the batch waits on) off a crowded engine onto the least loaded
one, once per execution, when the destination runs at most half the source's load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from services.scheduler.policy import staleness
from services.scheduler.policy.actions import (
    Action,
    DispatchBurst,
    Hold,
    Migrate,
    MoveToTraining,
    PlanMoves,
    ReturnToRollout,
)
from services.scheduler.policy.common import dispatch_to_gate, drained_actions, publish_newest, repair_prefix
from services.scheduler.policy.snapshot import (
    IN_FLIGHT,
    TRAINING_SIDE,
    CellState,
    CellView,
    Pipeline,
    Snapshot,
    training_set,
)


def rollout_capacity(cells: Iterable[CellView], p: Pipeline) -> int:
    """Executions the rollout cells hold without evicting: each cell's slots, or what its KV
    cache keeps resident at the measured context (:meth:`Pipeline.kv_slots`), if fewer."""
    return sum(p.kv_slots(c.slots) for c in cells if c.state is CellState.ROLLOUT)


@dataclasses.dataclass(frozen=True)
class GyreConfig:
    """Parameters of :class:`GyrePolicy`; the booleans are the ablation levers."""

    min_horizon_s: float = 300.0
    """Horizon over which the training prefix drains the trainer's queue, seconds (> 0)."""
    hysteresis: float = 0.2
    """Cells kept beyond the target before one returns, as a fraction of the target."""
    plan_ahead: int = 2
    """Cells planned beyond the target's next moves."""
    rates: bool = True
    """Size the prefix from rates; False: move while W_eta is covered and half a batch is
    ready (the seed's threshold, without its timer), return when nothing is ready."""
    keep: bool = True
    """Hysteresis; False: return as soon as the target drops."""
    plan: bool = True
    """Issue PlanMoves (placement avoids planned cells)."""
    migrate: bool = True
    """Migrate tail executions off crowded engines."""
    migrate_max: int = 4
    """Migrations per decision."""
    migrate_min_load: float = 0.5
    """Only engines above this fraction of their slots give tail executions away."""
    saturated_share: float = 0.6
    """Share of the rate target the prefix is sized to while rollout is saturated (W_eta
    exceeds the slots of the cells the target leaves to rollout); 1 turns this off."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a partial batch is sealed (task source exhausted)."""
    breathe: bool = True
    """Breathing: while there is training work, every cell W_eta leaves idle trains (spare
    cells join the streaming batch); while there is none and committed work waits for slots,
    the core goes back to rollout too; False: the rate target alone (the core never leaves)."""
    breathe_in: float = 0.5
    """Ready groups, as a fraction of the batch, that bring a breathing core back to training
    even when rollout could use its slots (the trainer is then the pipeline's next step)."""
    lend_min_s: float = 5.0
    """Training a lent cell must find, in seconds at the measured rate (the claimable tokens
    shared with the cells already training), at least: below it a join only moves the cell
    there and back. The bar is the measured switch round trip (``Pipeline.switch_s``) when that
    is longer (the simulator's costs x5: 18 s)."""
    kv: bool = True
    """Rollout capacity in executions the KV cache keeps resident (``Pipeline.kv_slots``: the
    cell's KV tokens over the measured mean context), where that is fewer than the slots;
    False: slots alone. Measured on A64 (seeds 1-2): slots alone let moves and lending pack
    agents of ~50k tokens of context 48 to a cell whose KV keeps ~37, and every turn of an
    evicted agent prefilled its whole context again."""
    kv_cut_share: float = 0.1
    """Share of the rollout cells' time spent recomputing evicted prefixes
    (``Pipeline.kv_recompute_share``) from which dispatch is cut to what the rollout cells'
    KV keeps (with ``kv``); 1 turns the cut off."""
    kv_fill: float = 0.6
    """Share of a cell's KV cache the capacity counts on (``kv_slots`` at
    ``kv_fill x kv_tokens_per_cell``); the rest is headroom for the contexts that grow as
    agents decode and for cells that hold longer agents than the mean (placement balances
    executions, not tokens). 1: the whole cache. See "Capacity in KV" in the module
    docstring."""
    kv_headroom_after: float = 0.05
    """The headroom of ``kv_fill`` applies once recomputing evicted prefixes has taken this
    share of the rollout cells' time in the run (``Pipeline.kv_recompute_peak``); until then
    the capacity counts on the whole KV. Where recompute is not measured (the peak is None)
    the headroom applies from the start. 0: always. See "Capacity in KV" in the module
    docstring."""
    parallel_moves: float = 1 / 32
    """Moves to training in flight at once, as a fraction of the elastic cells (at least one;
    0: one at a time). See "Moves in flight" in the module docstring."""
    breathe_out: float = 0.5
    """Executions waiting for slots, as a fraction of the core's slots, that send a breathing
    core to rollout: a switch each way is not worth two waiting executions."""
    wave_waits: bool = True
    """A dispatch of at least half a batch (a publication's wave) waits while elastic cells
    are on their way back to rollout, so that it spreads over them too. See "The wave waits"
    in the module docstring."""

    def __post_init__(self) -> None:
        if not (self.min_horizon_s > 0 and math.isfinite(self.min_horizon_s)):
            raise ValueError("min_horizon_s must be finite and > 0")
        if not 0 < self.saturated_share <= 1:
            raise ValueError("saturated_share must be in (0, 1]")
        if not 0 < self.breathe_in <= 1:
            raise ValueError("breathe_in must be in (0, 1]")
        if not 0 < self.kv_fill <= 1:
            raise ValueError("kv_fill must be in (0, 1]")
        if not 0 <= self.kv_headroom_after <= 1:
            raise ValueError("kv_headroom_after must be in [0, 1]")
        if not 0 < self.kv_cut_share <= 1:
            raise ValueError("kv_cut_share must be in (0, 1]")
        if not 0 <= self.breathe_out <= 1:
            raise ValueError("breathe_out must be in [0, 1]")
        if not 0 <= self.parallel_moves <= 1:
            raise ValueError("parallel_moves must be in [0, 1]")
        if self.lend_min_s < 0:
            raise ValueError("lend_min_s must be >= 0")
        if self.hysteresis < 0 or self.plan_ahead < 0 or self.migrate_max < 0:
            raise ValueError("hysteresis, plan_ahead and migrate_max must be >= 0")


def rate_target(p: Pipeline, horizon_s: float) -> tuple[int, str]:
    """T_rate: training cells that keep up with the arrival of ready groups and drain the
    trainer's queue (its backlog plus every ready group) within ``horizon_s`` (see the
    module docstring), with the reason in words."""
    r = p.train_rate_per_cell
    if r <= 0:
        return 1, "no training rate known"
    g = p.tokens_per_group or (p.ready_tokens / p.ready_groups if p.ready_groups else 0.0)
    backlog = 0.0 if p.optimizing else p.backlog_tokens
    queue = backlog + p.ready_groups * g
    arrivals = p.ready_rate * g
    t = math.ceil((arrivals + queue / horizon_s) / r - 1e-9)
    return max(1, t), (
        f"arrivals {arrivals:.3g} tok/s + queue {queue:.3g} tok over {horizon_s:.0f} s at {r:.3g} tok/s/cell"
    )


def claimable_work(p: Pipeline) -> bool:
    """Work a cell joining now could claim, now or as the batch in progress fills: ready
    groups, or a batch with groups assigned (its stragglers' groups come next), and not only
    the optimizer step, which is the core's alone."""
    return not p.optimizing and (p.ready_groups > 0 or p.backlog_tokens > 0 or p.batch_assigned > 0)


class GyrePolicy:
    """Gyre: see the module docstring."""

    name = "gyre"

    def __init__(self, config: GyreConfig | None = None, name: str = "gyre") -> None:
        self.config = config or GyreConfig()
        self.name = name

    # -- targets -----------------------------------------------------------------------------

    def target(self, s: Snapshot, elastic: list[CellView], w: int) -> tuple[int, int, int, str]:
        """The training prefix Gyre wants now (capped so rollout covers ``w``; breathing: with
        the spare cells lent, or 0 while the core rolls out), the rate target without that cap
        (what returns are measured against), the rate target before the
        saturated share (what the hysteresis band is a fraction of), and why."""
        p = s.pipeline
        assert p is not None
        slots = p.kv_slots(max((c.slots for c in elastic), default=1) or 1)
        standalone = rollout_capacity((c for c in s.cells if not c.elastic), p)
        t_max = len(elastic) - staleness.cells_to_cover(max(0, w - standalone), slots)
        if self.config.rates:
            t, why = rate_target(p, self.config.min_horizon_s)
        else:
            t = (
                len(elastic)
                if p.ready_groups >= p.batch_groups // 2
                else (len(training_set(elastic)) if p.ready_groups > 0 else 1)
            )
            why = f"ready {p.ready_groups} of {p.batch_groups} (threshold)"
        keep = t if t <= len(elastic) else max(1, len(elastic))
        band = keep
        share = self.config.saturated_share
        if self.config.rates and share < 1 and w - standalone > slots * (len(elastic) - keep):
            # Rollout saturated: W_eta would not fit the cells the target leaves to rollout.
            keep = max(1, round(keep * share))
            why += f"; rollout saturated (W_eta {w} > the slots the target leaves): x{share:g}"
        if self.lends(p) and claimable_work(p) and t_max > band and w > 0 and self.worth_lending(p, elastic):
            # Breathing in: the cells W_eta leaves idle train instead (rollout has no work for
            # them; the streaming batch takes them at once). ``keep`` stays the rate target:
            # lent cells go back as soon as rollout needs their slots again. Not once W_eta
            # is 0: every group the window needs is in, the batch steps soon and its
            # publication's dispatch would send a lent cell straight back (seen in the demo:
            # lent and returned within 0.6 s).
            return (
                t_max,
                keep,
                band,
                f"{why}; {t_max - keep} spare cell(s) lent: W_eta {w} leaves them idle",
            )
        if self.breathing(p, band):
            # The core breathes for a light trainer only (one cell keeps up with the
            # arrivals): its work comes a batch at a time and is short, and the rate rule
            # would park the core on it between batches. Above that the rate rule sizes the
            # prefix and the core's work is continuous.
            if self.core_may_leave(s, elastic, w):
                return (
                    0,
                    0,
                    band,
                    f"{why}; nothing to train and W_eta {w} waits for slots: the core rolls out",
                )
        if keep > t_max:
            return max(1, t_max), keep, band, f"{why}; capped at {t_max} to cover W_eta {w}"
        return keep, keep, band, why

    def worth_lending(self, p: Pipeline, elastic: list[CellView]) -> bool:
        """A lent cell would find at least ``lend_min_s`` of training, or the measured switch
        round trip if longer: the claimable tokens (the batch's backlog and the ready groups),
        shared with the cells training now and it, at the measured rate per cell."""
        claimable = (0.0 if p.optimizing else p.backlog_tokens) + p.ready_tokens
        cells = len(training_set(elastic)) + 1
        return claimable / (cells * p.train_rate_per_cell) >= max(self.config.lend_min_s, p.switch_s)

    def lends(self, p: Pipeline) -> bool:
        """Spare cells may be lent: breathing on and a training rate measured (at any rate
        target: empty cells only, priced by ``lend_min_s``; see the module docstring)."""
        return self.config.breathe and p.train_rate_per_cell > 0

    def breathing(self, p: Pipeline, band: int) -> bool:
        """Breathing applies: on, a training rate measured, and one cell keeps up with the
        arrivals (``band``: the rate target before the saturated share)."""
        return self.config.breathe and band <= 1 and p.train_rate_per_cell > 0

    def core_may_leave(self, s: Snapshot, elastic: list[CellView], w: int) -> bool:
        """Breathing out: the trainer has nothing to do (no batch in progress, fewer ready
        groups than bring it back) and the committed work W_eta exceeds what rollout holds
        without the core by ``breathe_out`` of its slots, so they would be used at once (the
        demo's core left for 2 waiting executions and was back a second later, when W_eta
        dipped under the capacity again). (The caller also asks that one
        cell keeps up with the arrivals: with a rate target above 1 groups arrive steadily and
        an empty queue is a moment between them, not a lull.)"""
        p = s.pipeline
        assert p is not None
        if p.batch_assigned > 0 or p.optimizing or p.backlog_tokens > 0:
            return False
        if p.ready_groups >= self.breathe_in_groups(p):
            return False
        slots = p.kv_slots(max((c.slots for c in elastic), default=0))
        standalone = rollout_capacity((c for c in s.cells if not c.elastic), p)
        waiting = w - standalone - slots * (len(elastic) - 1)
        return waiting > 0 and waiting >= self.config.breathe_out * slots

    def keeps_headroom(self, p: Pipeline) -> bool:
        """The capacity counts on ``kv_fill`` of each cell's KV: once recomputing evicted
        prefixes has taken ``kv_headroom_after`` of rollout's time in the run, or from the
        start where recompute is not measured."""
        peak = p.kv_recompute_peak
        return peak is None or peak >= self.config.kv_headroom_after

    def breathe_in_groups(self, p: Pipeline) -> int:
        """Ready groups that bring a breathing core back (at least one)."""
        return max(1, math.ceil(self.config.breathe_in * p.batch_groups))

    # -- decide ------------------------------------------------------------------------------

    def decide(self, s: Snapshot) -> list[Action]:
        p = s.pipeline
        if p is None:
            return [Hold("gyre needs the pipeline view (per-version ledger, rates)")]
        if not self.config.kv and p.context_tokens:
            p = dataclasses.replace(p, context_tokens=0.0)
            s = dataclasses.replace(s, pipeline=p)
        elif self.config.kv_fill < 1 and p.kv_tokens_per_cell > 0 and self.keeps_headroom(p):
            # Headroom: what the capacity counts on is kv_fill of each cell's KV.
            p = dataclasses.replace(p, kv_tokens_per_cell=p.kv_tokens_per_cell * self.config.kv_fill)
            s = dataclasses.replace(s, pipeline=p)
        dispatch = self._wave_waits(s, self._kv_bounded(s, dispatch_to_gate(s)))
        actions: list[Action] = publish_newest(s) + dispatch
        elastic = [c for c in s.elastic() if c.state is not CellState.FAILED]
        prefix = training_set(elastic)
        repair = repair_prefix(s.elastic(), prefix)
        if repair:
            return actions + repair
        # W_eta after this decision's own dispatch: at a publication the next batch's work
        # goes out now, and a move decided on W_eta before it would be undone by the next
        # decision (the core, told to breathe out a decision late, had already joined the
        # next batch and sat RETURNING until that batch stepped).
        dispatching = sum(a.quota for a in dispatch if isinstance(a, DispatchBurst))
        w = staleness.waterlevel(p, s.policy_version, dispatching)
        target, keep, band, why = self.target(s, elastic, w)
        actions += self._roles(s, elastic, prefix, target, keep, band, w, why)
        planned = p.planned
        if self.config.plan:
            planned = self._plan(elastic, prefix, target)
            if planned != p.planned:
                actions.append(
                    PlanMoves(
                        planned, f"planned next moves: {', '.join(planned) or 'none'} (target {target})"
                    )
                )
        if self.config.migrate:
            actions += self._migrate(s, planned)
        if not any(not isinstance(a, Hold) for a in actions):
            actions += drained_actions(s, self.config.drain_grace_s, prefix) or []
        return actions

    def _roles(
        self,
        s: Snapshot,
        elastic: list[CellView],
        prefix: list[CellView],
        target: int,
        keep: int,
        band: int,
        w: int,
        why: str,
    ) -> list[Action]:
        """One move towards ``target`` (capped to cover W_eta) or one return beyond ``keep``
        (the rate target uncapped) plus the hysteresis band."""
        t = len(prefix)
        if t < target:
            return self._moves(s, elastic, t, target, band, w, why)
        if target == 0 and t == 1 and prefix[0].is_core and prefix[0].state is CellState.TRAINING:
            return [
                ReturnToRollout(prefix[0].cell_id, f"returned core {prefix[0].cell_id} to rollout: {why}")
            ]
        assert s.pipeline is not None
        lending = self.lends(s.pipeline)
        light = self.breathing(s.pipeline, band)
        h = max(1, math.ceil(self.config.hysteresis * band)) if self.config.keep else 0
        # Lent: beyond the rate target before the saturated share (for a light trainer, every
        # cell but the core).
        lent = [c for c in prefix[max(1, band) :] if c.state is CellState.TRAINING]
        cap = rollout_capacity(s.cells, s.pipeline)
        needed = w > cap
        idle = not claimable_work(s.pipeline)
        if lending and lent and t > target and ((light and needed) or (not light and idle and not needed)):
            if lent[-1] is not prefix[-1]:
                return [
                    Hold(f"waiting: {prefix[-1].cell_id} is {prefix[-1].state.value}", prefix[-1].cell_id)
                ]
            # A lent cell (beyond the rate target) goes back once rollout's committed work
            # exceeds its slots again (at the next publication W_eta rises by a batch): no
            # hysteresis, it was only ever there because rollout could spare it. Above a rate
            # target of 1 a cell beyond the target goes back once nothing is left to claim
            # (W_eta's jumps are the rate rule's and its band's to answer: returning at each
            # jump flapped cells as saturation came and went, B64 at eta 4); kept idle in
            # training by the band instead, B64 (seed 1) ran 4% slower and at eta 0 5%.
            c = lent[-1]
            why_back = f"W_eta {w} > capacity {cap}" if needed else "nothing left to claim"
            return [ReturnToRollout(c.cell_id, f"returned lent {c.cell_id} to rollout: {why_back}")]
        if light and w <= cap:
            # Breathing: rollout could not use a returned cell (its committed work fits the
            # slots it has); a lent cell stays for the next batch instead of flapping out and
            # in as ready groups come and are claimed (seen in the demo: 4 moves in a second).
            return []
        if lending and (t <= target or (lent and not needed)):
            return []  # lent cells: the lending target, not the hysteresis band, holds them
        if t > keep + h:
            last = [c for c in prefix if c.state is CellState.TRAINING and not c.is_core]
            if last and last[-1] is not prefix[-1]:
                # The prefix ends with a cell still DRAINING: returning the one below it
                # would break the prefix (the repair then sends the drained one back too).
                return [
                    Hold(f"waiting: {prefix[-1].cell_id} is {prefix[-1].state.value}", prefix[-1].cell_id)
                ]
            if last:
                c = last[-1]
                return [
                    ReturnToRollout(
                        c.cell_id, f"returned {c.cell_id} to rollout: T {t} > target {keep} + {h} ({why})"
                    )
                ]
        return []

    def max_moves(self, elastic: int) -> int:
        """Moves to training in flight at once: ``parallel_moves`` of the elastic cells, at
        least one."""
        return max(1, math.floor(self.config.parallel_moves * elastic))

    def _moves(
        self, s: Snapshot, elastic: list[CellView], t: int, target: int, band: int, w: int, why: str
    ) -> list[Action]:
        """Moves towards ``target``, the next cells by index, as many as the moves in flight
        allow (``parallel_moves``): each candidate must pass the checks with the capacity and
        the free slots the earlier ones of this decision leave. The first that fails ends the
        decision (the training set stays a prefix), with a Hold that says why."""
        p = s.pipeline
        assert p is not None
        busy = [c for c in elastic if c.state is CellState.DRAINING]
        budget = min(self.max_moves(len(elastic)) - len(busy), target - t)
        if budget <= 0:
            return [Hold(f"waiting: {busy[0].cell_id} is DRAINING", busy[0].cell_id)]
        rest = [c for c in elastic if c.state not in TRAINING_SIDE]
        cap = rollout_capacity(s.cells, p)
        room = sum(c.slots - c.load for c in s.cells if c.state is CellState.ROLLOUT)
        out: list[Action] = []
        for cand in rest[:budget]:
            hold = self._blocked(cand, t + len(out), band, room)
            if hold is not None:
                return [*out, hold]
            cap -= p.kv_slots(cand.slots)
            room -= cand.slots
            n = t + len(out)
            ready = p.ready_groups
            if cap < w and cand.is_core and self.config.breathe and ready >= self.breathe_in_groups(p):
                # The trainer is the next step: without a new version the gate stays shut and
                # the work W_eta counts cannot grow; the core comes back whatever rollout holds.
                out.append(
                    MoveToTraining(
                        cand.cell_id,
                        f"moved core {cand.cell_id} back to training: {ready} groups ready "
                        f"({why}); capacity {cap} < W_eta {w}",
                    )
                )
                continue
            if cap < w:
                return [
                    *out,
                    Hold(f"kept {cand.cell_id} in rollout: capacity {cap} < W_eta {w}", cand.cell_id),
                ]
            out.append(
                MoveToTraining(
                    cand.cell_id,
                    f"moved {cand.cell_id} to training: T {n} -> {n + 1} of target {target} ({why}); "
                    f"capacity {cap} >= W_eta {w}",
                )
            )
        return out

    def _blocked(self, cand: CellView, n: int, band: int, room: int) -> Hold | None:
        """Why ``cand``, the next cell of a prefix of ``n``, cannot move now (None: it can).
        ``room``: the free slots of the rollout cells once this decision's earlier moves left."""
        if cand.state is not CellState.ROLLOUT:
            return Hold(f"waiting: next cell {cand.cell_id} is {cand.state.value}", cand.cell_id)
        if n + 1 > band and not cand.is_core and cand.load > 0:
            # A lent cell (beyond the rate target, breathing) joins only once it is empty:
            # its slots are spare only if nothing runs there, and PlanMoves keeps new
            # work off it meanwhile. Draining it would reroute its executions and
            # recompute their prefixes for a join the rate rule did not ask for (lending
            # busy cells cost A64 4% and B64 at eta 0 2% in the simulator).
            return Hold(f"waiting: {cand.cell_id} (lent, load {cand.load}) to empty", cand.cell_id)
        free = room - (cand.slots - cand.load)
        if cand.load > free:
            # Its executions are rerouted as it drains: with nowhere to go the move is
            # called off, and deciding it again every tick only repeats that (the demo's
            # core, back from breathing with rollout full: 4 moves called off in 2 s).
            return Hold(
                f"waiting: {cand.cell_id}'s {cand.load} executions have {free} free slots elsewhere",
                cand.cell_id,
            )
        return None

    def _wave_waits(self, s: Snapshot, dispatch: list[Action]) -> list[Action]:
        """A dispatch of at least half a batch holds while elastic cells return to rollout
        (with ``wave_waits``): placed now it would fill only the cells already there, and
        the returning ones would come up with nothing to run (placement never moves it
        after). See "The wave waits" in the module docstring."""
        p = s.pipeline
        assert p is not None
        wave = sum(a.quota for a in dispatch if isinstance(a, DispatchBurst))
        if not self.config.wave_waits or wave <= 0 or 2 * wave < p.batch_groups * p.group_size:
            return dispatch
        back = [c.cell_id for c in s.elastic() if c.state is CellState.RETURNING]
        if not back:
            return dispatch
        held: list[Action] = [a for a in dispatch if not isinstance(a, DispatchBurst)]
        why = f"waiting: a wave of {wave // p.group_size} groups waits for {', '.join(back)} returning to rollout"
        return [*held, Hold(why, back[0])]

    def _kv_bounded(self, s: Snapshot, dispatch: list[Action]) -> list[Action]:
        """The gate's dispatch, cut to whole groups so that the open executions stay within
        what the rollout cells' KV keeps, while recomputing evicted prefixes takes at least
        ``kv_cut_share`` of the rollout cells' time (see the module docstring)."""
        p = s.pipeline
        assert p is not None
        if not dispatch or p.context_tokens <= 0 or p.kv_recompute_share < self.config.kv_cut_share:
            return dispatch  # (with ``kv`` off, decide() has zeroed the context)
        cap = rollout_capacity(s.cells, p)
        open_now = sum(v.open for v in p.versions)
        out: list[Action] = []
        for a in dispatch:
            if isinstance(a, DispatchBurst):
                room = (cap - open_now) // p.group_size * p.group_size
                if open_now == 0:
                    room = max(room, p.group_size)  # a group always goes out: never a stall
                if room <= 0:
                    continue
                if room < a.quota:
                    a = dataclasses.replace(
                        a,
                        quota=room,
                        reason=f"{a.reason}; cut to {room}: recomputing evicted prefixes takes "
                        f"{p.kv_recompute_share:.0%} of rollout, and its KV keeps {cap} executions",
                    )
                open_now += a.quota
            out.append(a)
        return out

    def _plan(self, elastic: list[CellView], prefix: list[CellView], target: int) -> tuple[str, ...]:
        """The cells the target takes next, plus ``plan_ahead``, in move order."""
        k = max(0, target - len(prefix)) + self.config.plan_ahead
        rest = [c for c in elastic if c.state not in TRAINING_SIDE and c.state not in IN_FLIGHT]
        return tuple(c.cell_id for c in rest[:k])

    def _migrate(self, s: Snapshot, plan: tuple[str, ...]) -> list[Action]:
        if not s.executions:
            return []
        planned = set(plan)
        load = {c.cell_id: c.load for c in s.cells if c.state is CellState.ROLLOUT}
        slots = {c.cell_id: c.slots for c in s.cells}
        dests = sorted((cid for cid in load if cid not in planned), key=lambda cid: (load[cid], cid))
        out: list[Action] = []
        for ex in sorted(s.executions, key=lambda e: (-e.running_s, e.execution_id)):
            if len(out) >= self.config.migrate_max or not dests:
                break
            src = ex.cell_id
            if (
                ex.moves > 0
                or src not in load
                or load[src] <= self.config.migrate_min_load * slots.get(src, 0)
            ):
                continue
            dst = dests[0]
            if dst == src or load[dst] + 1 > load[src] / 2 or load[dst] >= slots.get(dst, 0):
                continue
            out.append(
                Migrate(
                    ex.execution_id,
                    dst,
                    f"migrated {ex.execution_id} (v{ex.version}, {ex.running_s:.0f} s) from {src} "
                    f"(load {load[src]}) to {dst} (load {load[dst]})",
                )
            )
            load[src] -= 1
            load[dst] += 1
            dests.sort(key=lambda cid: (load[cid], cid))
        return out
