"""Lower bounds on the time to N policy updates of a scenario (docs/design/workloads.md,
"Physical limit").

Both bounds share the per-group costs of the trace: for update k they look at the groups
dispatched for it (a quota of ``batch_groups x (1 + over-provision)`` groups) and let the
best case pick. A group's *work* is the rollout GPU-s of its members at the best feasible
decode batch (``slots_per_cell`` sequences sharing each weight read) plus their prefill,
plus its training GPU-s; its *alone latency* is its slowest member at the best per-sequence
speed (alone on an engine) with its sandbox, tool and reward waits.

* ``physical_limit`` — the one-burst bound T* (kept for comparison with earlier reports):
  max(work bound, critical path), the work bound being every update's ``batch_groups``
  cheapest groups plus one optimizer step per update, over all cells; the critical path
  the slowest ``batch_groups``-th fastest group of any update plus the final training step.
  It counts one burst's latency, not one per update, and ignores the staleness bound.
* ``staleness_limit`` — T*_eta, which respects the staleness bound eta: a group consumed by
  batch k (trained at version k, published as version k+1 at time t_{k+1}) must have been
  dispatched at version >= k - eta, so it cannot start before t_{max(0, k-eta)}. The
  publish times obey (``publish_times``)

      t_0 = 0,
      t_{k+1} >= t_k + train_k / cells + tau_opt                  (batch k trains after t_k)
      t_{k+1} >= t_{max(0,k-eta)} + L_k + tail_k                  (its B-th group's latency)
      t_{k+1} >= t_m + (sum of rollout_j, j >= m + eta, j <= k     (work that cannot start
                        + sum of train_j, m <= j <= k) / cells       before t_m), m = 1..k
      t_{k+1} >= (sum of rollout_j + train_j, j <= k) / cells      (m = 0: all the work)

  with L_k the B-th fastest alone latency among the groups eligible for batch k,
  tail_k = tau_opt + the least training time of one of them on every cell, rollout_j /
  train_j the GPU-s of the B cheapest groups eligible for batch j (train_j with one
  optimizer step), tau_opt the optimizer's fixed step. T*_eta = t_N.

  *Eligible for batch k*: tasks are dispatched in trace order, and every task before
  ``max(0, k - eta) x B`` went out before t_{k-eta} (the batches before k - eta consumed that
  many), so it is too old for batch k. The last task batch k can draw depends on the policy
  (a bursty split dispatches ``q = B (1 + over-provision)`` per version, the staleness gate
  ``(v + eta + 1) B + X`` usable ones, and the cancel-early rule replaces what it cancels);
  the bound allows ``2 (k + eta + 1) q``: every quota up to version k + eta and as many
  replacements. L_k and the training step use that window at the earliest version batch k
  may carry (``max(0, k - eta)``); the work terms take, for each range of batches, the
  cheapest distinct groups of the tasks they may come from, at version 0 (under growing
  drift the shortest). A policy that burns more tasks than that per version could beat
  the bound; efficiency > 1 in a report would say so. Under the partial rule
  (``stale_rule: partial``) a restamped group may be consumed any number of versions after
  its dispatch, so the recursion runs with eta = N: the work and optimizer chain.

* ``gate_path`` — the dispatch gate's latency path, a lower bound for the policies that
  dispatch under the staleness gate (``gyre``, ``async-static``, ``async-static-lend``): the
  mechanism those policies share, played with every group at its alone latency, unlimited
  rollout slots and every cell training. Tasks go out in trace order, each stamped with the
  version it is dispatched at, whenever the gate ``(v + eta + 1) B + X`` has room (not at
  eta = 0 while the batch in progress is full); batch v takes the ready groups it may
  consume first-come first-served; when it has B, the unassigned groups stamped v - eta or
  older are cancelled and replaced; it publishes at ``max(t_v + train_v / cells, f_v +
  train_last / cells) + tau_opt`` (f_v: when its last group was assigned). A policy under
  the gate plays this schedule with slower groups (shared engines decode each sequence
  slower than alone), fewer training cells and later decisions, so it should not finish
  earlier. That is an argument, not a proof (slower groups also change which groups are
  cancelled): it is checked on the unit tests' small scenario and held in every gated run
  of ``bench/results/cluster.json`` (each at least 1.11x its path). The gap between this
  path and a policy's time is what decode sharing, queueing for slots and role switches
  cost; the gap between T*_eta and this path is what the gate and the cancel rule cost
  (T*_eta lets each batch pick from a wide window). Under the partial rule the path plays
  it too: an open group that the cancel rule would stop is restamped and goes on, and only
  ready copies are dropped.

Both are lower bounds under the simulator's assumptions (the trace, the cost model, one
batch of B groups per update); role switches, reroutes, weight sync, queueing and the work
of cancelled groups are costs of a policy, not of the bound. Efficiency = bound / T.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gyre.staleness import PARTIAL
from sim.config import ScenarioConfig, SimConfig
from sim.cost import CostModel
from sim.workload import Episode, make_trace


@dataclass(frozen=True)
class Bound:
    """T* and its parts, in seconds."""

    t_star_s: float
    work_bound_s: float
    critical_path_s: float
    rollout_gpu_s: float
    prefill_gpu_s: float
    train_gpu_s: float
    slowest_needed_group_s: float


@dataclass(frozen=True)
class StalenessBound:
    """T*_eta, the publish times of the recursion, and which constraint set each one."""

    t_star_eta_s: float
    eta: int
    publish_times_s: tuple[float, ...]  # t_1 .. t_N
    binding: tuple[str, ...]  # per update: "train", "latency" or "work"
    work_bound_s: float  # all the work over all cells (the m = 0 term at k = N-1)
    latency_s: tuple[float, ...]  # L_k


@dataclass(frozen=True)
class GroupCost:
    """One group's costs at the best case (see the module docstring)."""

    decode_gpu_s: float
    prefill_gpu_s: float
    train_gpu_s: float
    tokens: float  # training work, 6N-equivalent tokens (CostModel.train_work_tokens)
    alone_s: float
    work: float  # decode + prefill + train GPU-s


def _episode_costs(ep: Episode, cost: CostModel, best_batch: int) -> tuple[float, float, float]:
    """(decode GPU-s at the best batch, prefill GPU-s, latency alone at best speed)."""
    ctx = 0
    decode_gpu = 0.0
    prefill = 0.0
    alone = ep.sandbox_s + ep.reward_s
    for k, n in enumerate(ep.output_tokens):
        p = ep.prompt_tokens[k]
        pf = cost.prefill_s(p, ctx)
        ctx += p
        prefill += pf
        batched = cost.decode_rate(best_batch, best_batch * ctx).time(0.0, n) / best_batch
        single = cost.decode_rate(1, ctx).time(0.0, n)
        decode_gpu += batched
        alone += pf + single + ep.tool_s[k]
        ctx += n
    return decode_gpu, prefill, alone


def _decode_time(cost: CostModel, batch: int, ctx: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``DecodeRate.time(0, n)`` of ``cost.decode_rate(batch, batch * ctx)`` per element."""
    c = cost.cfg
    comp = 2.0 * c.n_params * batch / (c.decode_flops_eff * c.flops * c.gpus_per_cell)
    bw = c.hbm_eff * c.hbm_bw * c.gpus_per_cell
    m0 = (c.weight_bytes + c.kv_bytes_per_token * batch * ctx) / bw
    m1 = c.kv_bytes_per_token * batch / bw
    oh = c.decode_step_overhead_s
    vc = (comp - m0) / m1  # memory overtakes compute at V = vc (m1 > 0)
    seg = np.clip(vc, 0.0, n)  # the compute-bound stretch
    return (comp + oh) * seg + (m0 + oh) * (n - seg) + 0.5 * m1 * (n * n - seg * seg)


def _episode_costs_np(ep: Episode, cost: CostModel, best_batch: int) -> tuple[float, float, float]:
    """``_episode_costs`` vectorized over the turns (the same formulas; floats may differ in
    the last bits, which the bound does not care about)."""
    p = np.asarray(ep.prompt_tokens, dtype=float)
    n = np.asarray(ep.output_tokens, dtype=float)
    before = np.concatenate(([0.0], np.cumsum(p + n)[:-1]))  # context before each turn's prompt
    c = cost.cfg
    pf = (
        p
        * (2.0 * c.n_params + 4.0 * c.n_layers * c.d_model * (before + p / 2.0))
        / (c.prefill_flops_eff * c.flops * c.gpus_per_cell)
    )
    ctx = before + p
    batched = _decode_time(cost, best_batch, ctx, n) / best_batch
    single = _decode_time(cost, 1, ctx, n)
    alone = ep.sandbox_s + ep.reward_s + float(pf.sum() + single.sum()) + sum(ep.tool_s)
    return float(batched.sum()), float(pf.sum()), alone


def group_cost(eps: Sequence[Episode], cost: CostModel, best_batch: int, fast: bool = False) -> GroupCost:
    parts = [(_episode_costs_np if fast else _episode_costs)(ep, cost, best_batch) for ep in eps]
    tokens = sum(cost.train_work_tokens(ep.total_tokens) for ep in eps)
    train = tokens / cost.train_tokens_per_cell_s()
    return GroupCost(
        decode_gpu_s=sum(d for d, _, _ in parts),
        prefill_gpu_s=sum(p for _, p, _ in parts),
        train_gpu_s=train,
        tokens=tokens,
        alone_s=max(a for _, _, a in parts),
        work=sum(d + p for d, p, _ in parts) + train,
    )


def quota_groups(sc: ScenarioConfig) -> int:
    """Groups dispatched per update (the batch with its over-provision)."""
    tr = sc.training
    return max(tr.batch_groups, math.ceil(tr.batch_groups * (1 + tr.overprovision) - 1e-9))


class _Costs:
    """Group costs of one scenario's trace, by (task, version)."""

    def __init__(self, cfg: SimConfig, sc: ScenarioConfig) -> None:
        self.trace = make_trace(cfg, sc)
        self.drift = sc.drift
        self.cost = CostModel(cfg.cost)
        self.best_batch = sc.cluster.slots_per_cell
        self.per_burst = quota_groups(sc)
        self._memo: dict[tuple[int, float], GroupCost] = {}
        self._fast: dict[tuple[int, float], GroupCost] = {}

    def tasks(self, tasks: range, version: int, fast: bool = False) -> list[GroupCost]:
        """Group costs of ``tasks`` drawn at ``version`` (``fast``: vectorized, for T*_eta)."""
        factor = self.drift.factor(version)
        memo = self._fast if fast else self._memo
        out = []
        for task in tasks:
            key = (task, factor)
            g = memo.get(key)
            if g is None:
                g = memo[key] = group_cost(self.trace.group(task, version), self.cost, self.best_batch, fast)
            out.append(g)
        return out

    def batch(self, k: int, version: int) -> list[GroupCost]:
        """The quota of update k (its burst of the bursty policies), drawn at ``version``."""
        return self.tasks(range(k * self.per_burst, (k + 1) * self.per_burst), version)


def physical_limit(cfg: SimConfig, sc: ScenarioConfig) -> Bound:
    """The one-burst T* for N = ``sc.training.updates`` updates of scenario ``sc``."""
    return _physical_limit(cfg, sc, _Costs(cfg, sc))


def _physical_limit(cfg: SimConfig, sc: ScenarioConfig, costs: _Costs) -> Bound:
    tr = sc.training
    cells = sc.cluster.cells
    rollout = prefill = train = 0.0
    slowest = 0.0
    last_train_tokens = 0.0
    tok_s = costs.cost.train_tokens_per_cell_s()
    for k in range(tr.updates):
        groups = [(g.work, g.alone_s, g.decode_gpu_s, g.prefill_gpu_s, g.tokens) for g in costs.batch(k, k)]
        by_work = sorted(groups)[: tr.batch_groups]
        rollout += sum(g[2] for g in by_work)
        prefill += sum(g[3] for g in by_work)
        tokens_k = sum(g[4] for g in by_work)
        train += tokens_k / tok_s + cfg.cost.train_step_fixed_s
        last_train_tokens = tokens_k
        needed = sorted(g[1] for g in groups)[tr.batch_groups - 1]
        slowest = max(slowest, needed)
    work_bound = (rollout + prefill + train) / cells
    critical = slowest + costs.cost.train_s(last_train_tokens, cells)
    return Bound(
        t_star_s=max(work_bound, critical),
        work_bound_s=work_bound,
        critical_path_s=critical,
        rollout_gpu_s=rollout,
        prefill_gpu_s=prefill,
        train_gpu_s=train,
        slowest_needed_group_s=slowest,
    )


def publish_times(
    latency: Sequence[float],
    tail: Sequence[float],
    rollout: Sequence[float],
    train: Sequence[float],
    cells: int,
    eta: int,
    tau_opt: float,
    work: Callable[[int, int], float] | None = None,
) -> tuple[list[float], list[str]]:
    """The recursion of T*_eta (module docstring): the earliest publish times t_1..t_N and,
    per update, the constraint that set it. ``latency[k]`` = L_k, ``tail[k]`` = tail_k,
    ``rollout[k]`` / ``train[k]`` = batch k's GPU-s (``train`` with its optimizer step);
    batch k trains on every cell in at least ``(train[k] - tau_opt) / cells`` + tau_opt.
    ``work(m, k)``, when given, is the GPU-s that cannot start before t_m and must be done
    by t_{k+1} (default: the sums of ``rollout`` over batches m+eta..k, all of them for
    m = 0, and of ``train`` over m..k)."""
    n = len(latency)
    if not (len(tail) == len(rollout) == len(train) == n):
        raise ValueError("latency, tail, rollout and train need one entry per update")
    if cells < 1 or eta < 0:
        raise ValueError("cells >= 1 and eta >= 0")
    t = [0.0]
    binding: list[str] = []
    for k in range(n):
        cands = {
            "train": t[k] + (train[k] - tau_opt) / cells + tau_opt,
            "latency": t[max(0, k - eta)] + latency[k] + tail[k],
        }
        best = 0.0
        for m in range(k + 1):
            if work is not None:
                w = work(m, k)
            else:
                first_rollout = 0 if m == 0 else m + eta
                w = sum(rollout[first_rollout : k + 1]) + sum(train[m : k + 1])
            best = max(best, t[m] + w / cells)
        cands["work"] = best
        why = max(cands, key=cands.__getitem__)
        t.append(cands[why])
        binding.append(why)
    return t[1:], binding


def staleness_limit(cfg: SimConfig, sc: ScenarioConfig) -> StalenessBound:
    """T*_eta for N = ``sc.training.updates`` updates of ``sc`` at eta = its max_staleness."""
    return _staleness_limit(cfg, sc, _Costs(cfg, sc))


def _staleness_limit(cfg: SimConfig, sc: ScenarioConfig, costs: _Costs) -> StalenessBound:
    tr = sc.training
    # Under the partial rule a restamped group may have been dispatched any number of
    # versions before the batch that takes it (at most eta + L with partial_max_versions L):
    # the recursion runs with eta = N (no latency window) or eta + L, a weaker bound that
    # still holds.
    eta = tr.max_staleness
    if tr.stale_rule == PARTIAL:
        eta = tr.updates if tr.partial_max_versions is None else eta + tr.partial_max_versions
    cells = sc.cluster.cells
    tau_opt = cfg.cost.train_step_fixed_s
    b = tr.batch_groups
    q = costs.per_burst
    n = tr.updates

    def lo(k: int) -> int:  # tasks before it were dispatched before t_{k-eta}: too old
        return max(0, k - eta) * b

    def hi(k: int) -> int:  # bursty quotas or the gate's window, plus a quota of replacements per version
        return 2 * (k + eta + 1) * q

    arrays: dict[tuple[int, int, int], np.ndarray] = {}

    def costs_of(first: int, end: int, version: int) -> np.ndarray:
        """(rollout GPU-s, training GPU-s, alone latency) of tasks [first, end) at version."""
        key = (first, end, version)
        if key not in arrays:
            gs = costs.tasks(range(first, end), version, fast=True)
            arrays[key] = np.array([(g.decode_gpu_s + g.prefill_gpu_s, g.train_gpu_s, g.alone_s) for g in gs])
        return arrays[key]

    def cheapest(x: np.ndarray, count: int) -> float:
        if count <= 0:
            return 0.0
        return float(np.partition(x, count - 1)[:count].sum())

    latency, tail, rollout, train = [], [], [], []
    for k in range(n):
        window = costs_of(lo(k), hi(k), max(0, k - eta))  # at the earliest version it may carry
        latency.append(float(np.partition(window[:, 2], b - 1)[b - 1]))
        tail.append(tau_opt + float(window[:, 1].min()) / cells)
        rollout.append(cheapest(window[:, 0], b))
        train.append(cheapest(window[:, 1], b) + tau_opt)

    def work(m: int, k: int) -> float:
        """GPU-s of batches that cannot start before t_m: the rollout of batches m+eta..k
        (all of them for m = 0) and the training of batches m..k, each the cheapest distinct
        groups of the tasks they may come from."""
        first = 0 if m == 0 else m + eta
        every = costs_of(0, hi(n - 1), 0)  # version 0: the shortest under growing drift
        r = cheapest(every[lo(first) : hi(k), 0], (k - first + 1) * b)
        t = cheapest(every[lo(m) : hi(k), 1], (k - m + 1) * b)
        return r + t + (k - m + 1) * tau_opt

    times, binding = publish_times(latency, tail, rollout, train, cells, eta, tau_opt, work=work)
    return StalenessBound(
        t_star_eta_s=times[-1],
        eta=eta,
        publish_times_s=tuple(times),
        binding=tuple(binding),
        work_bound_s=work(0, n - 1) / cells,
        latency_s=tuple(latency),
    )


def limits(cfg: SimConfig, sc: ScenarioConfig) -> tuple[Bound, StalenessBound, GatePath]:
    """T*, T*_eta and the gate's latency path, sharing the group costs."""
    costs = _Costs(cfg, sc)
    return _physical_limit(cfg, sc, costs), _staleness_limit(cfg, sc, costs), _gate_path(cfg, sc, costs)


@dataclass(frozen=True)
class GatePath:
    """The gate's latency path (``gate_path``): its publish times and what it dispatched."""

    t_s: float
    publish_times_s: tuple[float, ...]  # t_1 .. t_N
    dispatched: int
    cancelled: int


def gate_schedule(
    group: Callable[[int, int], tuple[float, float]],
    *,
    batch_groups: int,
    extra_groups: int,
    eta: int,
    updates: int,
    cells: int,
    tau_opt: float,
    partial: bool = False,
    partial_max_versions: int | None = None,
) -> GatePath:
    """The gate's latency path (module docstring) for groups whose alone latency and training
    GPU-s are ``group(task, stamp)`` (task: trace order, stamp: the version it is dispatched
    at). ``partial``: the partial rule instead of cancel early (an open group is restamped
    and goes on; only ready copies are dropped)."""
    if batch_groups < 1 or extra_groups < 0 or eta < 0 or updates < 1 or cells < 1:
        raise ValueError("batch_groups, updates, cells >= 1; extra_groups, eta >= 0")
    b = batch_groups
    stamp: list[int] = []  # per dispatched task
    origin: list[int] = []  # its first stamp
    train_s: list[float] = []
    state: list[str] = []  # "open", "ready" (in the pool), "assigned", "cancelled"
    running: list[tuple[float, int]] = []  # (ready time, task)
    pool: list[tuple[float, int]] = []  # ready, unassigned, in ready order
    batch: list[tuple[float, int]] = []  # (assigned at, task) of batch v
    usable = cancelled = 0
    settled = 0  # tasks before it are past the cancel rule (stamps grow with the task index)
    carried: list[int] = []  # restamped open tasks (the partial rule): checked again each batch
    v, t = 0, [0.0]

    def dispatch(now: float) -> None:
        nonlocal usable
        if eta == 0 and len(batch) >= b:
            return  # a group stamped v would be unconsumable at once: wait for the update
        while usable < (v + eta + 1) * b + extra_groups:
            task = len(stamp)
            alone, train = group(task, v)
            stamp.append(v)
            origin.append(v)
            train_s.append(train)
            state.append("open")
            usable += 1
            heapq.heappush(running, (now + alone, task))

    def assign(now: float) -> None:
        """Ready groups of the pool into batch v, first come first served; when it is full,
        the cancel-early rule."""
        nonlocal usable, cancelled, pool, settled, carried
        rest = []
        for r, task in pool:
            if len(batch) < b and v - stamp[task] <= eta:
                batch.append((max(r, now), task))
                state[task] = "assigned"
            else:
                rest.append((r, task))
        pool = rest
        if len(batch) < b:
            return
        doomed = list(carried)
        while settled < len(stamp) and stamp[settled] <= v - eta:
            doomed.append(settled)
            settled += 1
        carried = []
        for task in doomed:
            if stamp[task] > v - eta:
                carried.append(task)
            elif (
                state[task] == "open"
                and partial
                and (
                    partial_max_versions is None or max(v - eta + 1, v) - origin[task] <= partial_max_versions
                )
            ):
                stamp[task] = max(v - eta + 1, v)
                carried.append(task)
            elif state[task] in ("open", "ready"):
                state[task] = "cancelled"
                usable -= 1
                cancelled += 1
        pool = [(r, task) for r, task in pool if state[task] == "ready"]

    dispatch(0.0)
    while v < updates:
        if len(batch) < b:
            now, task = heapq.heappop(running)
            if state[task] == "cancelled":
                continue
            state[task] = "ready"
            pool.append((now, task))
            assign(now)
            dispatch(now)
            continue
        last_at, last = max(batch)
        work = sum(train_s[task] for _, task in batch)
        publish = max(t[v] + work / cells, last_at + train_s[last] / cells) + tau_opt
        while running and running[0][0] <= publish:  # ready while batch v trains: the pool
            r, task = heapq.heappop(running)
            if state[task] != "cancelled":
                state[task] = "ready"
                pool.append((r, task))
        v += 1
        t.append(publish)
        batch = []
        if v < updates:
            assign(publish)
            dispatch(publish)
    return GatePath(t[-1], tuple(t[1:]), len(stamp), cancelled)


def gate_path(cfg: SimConfig, sc: ScenarioConfig) -> GatePath:
    """The gate's latency path for N = ``sc.training.updates`` updates of ``sc``."""
    return _gate_path(cfg, sc, _Costs(cfg, sc))


def _gate_path(cfg: SimConfig, sc: ScenarioConfig, costs: _Costs) -> GatePath:
    tr = sc.training

    def group(task: int, version: int) -> tuple[float, float]:
        g = costs.tasks(range(task, task + 1), version, fast=True)[0]
        return g.alone_s, g.train_gpu_s

    return gate_schedule(
        group,
        batch_groups=tr.batch_groups,
        extra_groups=costs.per_burst - tr.batch_groups,
        eta=tr.max_staleness,
        updates=tr.updates,
        cells=sc.cluster.cells,
        tau_opt=cfg.cost.train_step_fixed_s,
        partial=tr.stale_rule == PARTIAL,
        partial_max_versions=tr.partial_max_versions,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.bounds [--config FILE] [--scenario NAME ...] [--seeds 1,2,3]``: T*,
    T*_eta and the gate's latency path of each scenario and seed, one JSON line each."""
    import argparse
    import json

    from sim.config import load_config

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", default="bench/cluster.yaml")
    ap.add_argument("--scenario", action="append", default=[], help="default: every scenario")
    ap.add_argument("--seeds", default="", help="comma-separated (default: the scenario's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    base = load_config(args.config, args.set)
    for name in args.scenario or [s.name for s in base.scenarios]:
        seeds = [int(x) for x in args.seeds.split(",") if x] or [base.scenario(name).seed]
        for seed in seeds:
            cfg = load_config(args.config, [*args.set, f"scenarios.{name}.seed={seed}"])
            sc = cfg.scenario(name)
            one, eta, gate = limits(cfg, sc)
            row = {
                "scenario": name,
                "seed": seed,
                "eta": eta.eta,
                "t_star_s": round(one.t_star_s, 1),
                "t_star_eta_s": round(eta.t_star_eta_s, 1),
                "gate_path_s": round(gate.t_s, 1),
                "gate_publish_times_s": [round(x, 1) for x in gate.publish_times_s],
                "gate_dispatched": gate.dispatched,
                "gate_cancelled": gate.cancelled,
            }
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
