"""The cluster benchmark's runner: every row of ``SimConfig.policies`` on every scenario and
seed, on the same trace and cell count, with both lower bounds, and the summary across
seeds that ``bench/results/cluster.json`` carries.

A row names a *role* (``gyre``, ``colocated``, ``oracle_async_static``, ...) and candidate
policies; the first candidate that the scheduler's registry (``make_policy``) knows runs,
so policies plug in as they land, and a row none of whose candidates exists is reported as
missing, never silently replaced. A swept row runs every training-cell count T of
``static_training_cells`` on its first placement, the best of them and its neighbours on
each further placement, then refines around the best, and keeps the best as the oracle
(chosen in hindsight, per seed). With ``sweep_cutoff`` a sweep point
stops once it runs that factor past the best point so far: it cannot be the oracle.

Beside that oracle, the baselines a user actually has (issue 33): a ``split`` row runs one
fixed share of the cells in training (the 50:50 split), and a ``prior`` row runs the split
the oracle chose on *another* seed (or a neighbouring scenario): chosen before the run,
without hindsight. Prior rows need the other seeds' sweeps, so ``run_all`` runs them in a
second pass. ``switch_sensitivity`` reruns Gyre and the oracle's best split with the switch
costs multiplied (the oracle is not re-swept: a static split never switches roles, only its
weight syncs get dearer, so its best T does not move).

Scenario x seed units are independent: ``run_all`` spreads them over worker processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import json
import math
import os
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.scheduler import policy as P
from sim.bounds import Bound, GatePath, StalenessBound, limits
from sim.config import PolicyEntry, ScenarioConfig, SimConfig, apply_variant
from sim.driver import PolicySpec, run_policy
from sim.metrics import RunResult

SUMMARY_ROLES = ("oracle_async_static", "prior_static", "half_static", "oracle_bursty_static", "colocated")
"""Baselines of the summary's ratios (baseline time / Gyre time)."""

SWITCH_COSTS = ("switch_to_train_s", "switch_to_rollout_s", "weight_sync_s")
"""The costs ``switch_sensitivity`` multiplies."""

PENDING = "runs in the second pass (needs the other seeds' oracles)"

Log = Callable[[str], None]

NOT_RUN = "not run in this report (regenerated from the runs that finished in time)"

CACHE_ONLY_ENV = "GYRE_SIM_CACHE_ONLY"
"""Set (to anything but "" or "0") with ``GYRE_SIM_CACHE``: report only the runs already in
the cache and list the others as not run (regenerating a report from a partial run)."""

CACHE_ENV = "GYRE_SIM_CACHE"
"""A directory where finished runs are kept, keyed by everything that determines them (the
config minus the rows and suites, the scenario with its seed and horizon, the policy spec,
and the source of the simulator and of the scheduler's policies: a policy change makes new
keys, so a rerun never reports a run of the code before it): runs are deterministic, so a
rerun of the benchmark reuses them. Unset: no cache."""

_CODE_DIRS = ("sim", "services/scheduler/policy")
_ROOT = Path(__file__).resolve().parents[1]
_GYRE_ONLY = "services/scheduler/policy/gyre.py"
"""Read by the gyre policy alone (the others never import it), so a change to Gyre leaves
the baselines' cached runs valid: tuning Gyre reruns only Gyre's runs (a full sweep of the
static splits is most of the benchmark's hour)."""


@functools.cache
def code_digest(gyre: bool = True) -> str:
    """A digest of the code a simulated run depends on: every module of the simulator and of
    the scheduler's policies (any change there may change a run), less Gyre's own module for
    a run of another policy (``gyre`` False)."""
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for path in sorted((_ROOT / d).rglob("*.py")):
            rel = path.relative_to(_ROOT).as_posix()
            if not gyre and rel == _GYRE_ONLY:
                continue
            h.update(rel.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _cache_path(cfg: SimConfig, sc: ScenarioConfig, spec: PolicySpec, record_every_s: float) -> Path | None:
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    top = cfg.model_dump(
        mode="json",
        exclude={
            "scenarios",
            "suites",
            "policies",
            "variants",
            "targets",
            "static_training_cells",
            "sweep_cutoff",
        },
    )
    key = json.dumps(
        {
            "cfg": top,
            "sc": sc.model_dump(mode="json", exclude={"seeds"}),
            "spec": vars(spec),
            "record": record_every_s,
            "code": code_digest(spec.name == "gyre"),
        },
        sort_keys=True,
    )
    return Path(root) / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".pkl")


def cached_run(
    cfg: SimConfig, sc: ScenarioConfig, spec: PolicySpec, record_every_s: float
) -> RunResult | None:
    """``run_policy``, through the cache of ``$GYRE_SIM_CACHE`` when it is set (None: not in
    the cache and ``$GYRE_SIM_CACHE_ONLY`` is set)."""
    path = _cache_path(cfg, sc, spec, record_every_s)
    if path is not None and path.exists():
        return pickle.loads(path.read_bytes())
    if path is not None and os.environ.get(CACHE_ONLY_ENV, "") not in ("", "0"):
        return None
    r = run_policy(cfg, sc, spec, record_every_s=record_every_s)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(r))
        tmp.replace(path)
    return r


def known_policy(name: str) -> bool:
    """Whether the scheduler's policy registry builds ``name``."""
    try:
        P.make_policy(name)
    except ValueError:
        return False
    return True


@dataclass
class SweepPoint:
    """One point of a split sweep; ``time_to_n_s`` None: cut past ``cut_at_s``."""

    policy: str
    training_cells: int
    placement: str
    time_to_n_s: float | None
    cut_at_s: float | None = None

    @property
    def label(self) -> str:
        return point_label(self.policy, self.training_cells, self.placement)


def point_label(policy: str, training_cells: int, placement: str) -> str:
    return f"{policy} T={training_cells} ({placement})"


@dataclass
class RoleResult:
    """What filled one row: the policy that ran and the run (for a sweep: the oracle)."""

    role: str
    policy: str | None
    label: str | None
    missing: str = ""
    sweep: list[SweepPoint] = field(default_factory=list)
    note: str = ""  # where a prior split came from


@dataclass
class ScenarioResult:
    """One scenario on one seed."""

    scenario: ScenarioConfig
    bound: Bound
    bound_eta: StalenessBound
    gate: GatePath | None = None
    """The gate's latency path (a bound for the policies that dispatch under the gate)."""
    runs: dict[str, RunResult] = field(default_factory=dict)  # by label
    roles: dict[str, RoleResult] = field(default_factory=dict)
    variants: dict[str, RunResult] = field(default_factory=dict)
    wall_s: float = 0.0

    def run(self, role: str) -> RunResult | None:
        rr = self.roles.get(role)
        return self.runs.get(rr.label) if rr is not None and rr.label else None

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.model_dump(),
            "bound": vars(self.bound),
            "bound_eta": vars(self.bound_eta),
            "gate_path": vars(self.gate) if self.gate is not None else None,
            "roles": {k: vars(v) | {"sweep": [vars(p) for p in v.sweep]} for k, v in self.roles.items()},
            "runs": {k: r.to_json(with_series=False) for k, r in self.runs.items()},
            "variants": {k: r.to_json(with_series=False) for k, r in self.variants.items()},
            "wall_s": self.wall_s,
        }


def _with(sc: ScenarioConfig, placement: str | None = None, horizon_s: float | None = None) -> ScenarioConfig:
    upd: dict[str, Any] = {}
    if placement is not None and placement != sc.cluster.placement:
        upd["cluster"] = sc.cluster.model_copy(update={"placement": placement})
    if horizon_s is not None and horizon_s < sc.training.horizon_s:
        upd["training"] = sc.training.model_copy(update={"horizon_s": horizon_s})
    return sc.model_copy(update=upd) if upd else sc


def _refine(coarse: list[int], best: int, cells: int) -> list[int]:
    """Split points between the best coarse point and its neighbours."""
    pts = sorted(set(coarse))
    i = pts.index(best)
    lo = pts[i - 1] if i > 0 else max(1, best // 2)
    hi = pts[i + 1] if i + 1 < len(pts) else min(cells - 1, best + (best - lo))
    return sorted({t for t in ((lo + best) // 2, (best + hi) // 2) if 1 <= t < cells and t not in pts})


def _neighbours(coarse: list[int], t: int) -> list[int]:
    """``t`` and the coarse points on either side of it."""
    pts = sorted(set(coarse) | {t})
    i = pts.index(t)
    return pts[max(0, i - 1) : i + 2]


def _middle_out(points: list[int]) -> list[int]:
    """The middle point first (the likeliest best: later points are cut against it)."""
    pts = sorted(points)
    mid = len(pts) // 2
    return sorted(pts, key=lambda t: (abs(pts.index(t) - mid), t))


class _Runner:
    """Runs the rows of one scenario x seed."""

    def __init__(
        self, cfg: SimConfig, sc: ScenarioConfig, res: ScenarioResult, record_every_s: float, log: Log
    ) -> None:
        self.cfg, self.sc, self.res, self.record_every_s, self.log = cfg, sc, res, record_every_s, log

    def one(
        self, spec: PolicySpec, sc: ScenarioConfig, label: str, cfg: SimConfig | None = None
    ) -> RunResult | None:
        r = cached_run(cfg or self.cfg, sc, spec, self.record_every_s)
        if r is None:
            self.log(f"[{sc.name} seed {sc.seed}] {label:34s} not run (not in the cache)")
            return None
        r.label = label
        shown = f"{r.time_to_n_s:9.0f} s" if r.reached else f"  > {sc.training.horizon_s:.0f} s (cut)"
        self.log(
            f"[{sc.name} seed {sc.seed}] {label:34s} time to {sc.training.updates} updates {shown}  "
            f"({r.events_processed} events, {r.sim_wall_s:.1f} s wall)"
        )
        return r

    def row(self, entry: PolicyEntry) -> RoleResult:
        name = next((n for n in entry.policy if known_policy(n)), None)
        if name is None:
            why = f"no policy of {entry.policy} is in the scheduler's registry yet"
            self.log(f"[{self.sc.name} seed {self.sc.seed}] {entry.role}: MISSING ({why})")
            return RoleResult(entry.role, None, None, missing=why)
        if entry.prior is not None:
            return RoleResult(entry.role, None, None, missing=PENDING)
        if entry.split is not None:
            where = entry.placements[0] if entry.placements else self.sc.cluster.placement
            return self.fixed(entry.role, name, _scaled(entry.split, self.sc.cluster.cells), where)
        if entry.at is not None:
            return self.at(entry, name)
        if not entry.sweep:
            r = self.one(PolicySpec(name), self.sc, name)
            if r is None:
                return RoleResult(entry.role, None, None, missing=NOT_RUN)
            self.res.runs[name] = r
            return RoleResult(entry.role, name, name)
        return self.sweep(entry, name)

    def fixed(
        self, role: str, name: str, t: int, placement: str, cfg: SimConfig | None = None, suffix: str = ""
    ) -> RoleResult:
        """One run at T training cells (reusing a sweep point of the same label)."""
        label = point_label(name, t, placement) + suffix
        r = self.res.runs.get(label) if cfg is None else None
        if r is None:
            r = self.one(PolicySpec(name, training_cells=t), _with(self.sc, placement), label, cfg)
        if r is None:
            return RoleResult(role, None, None, missing=NOT_RUN)
        self.res.runs[label] = r
        return RoleResult(
            role, name, label if r.reached else None, missing="" if r.reached else "did not reach N"
        )

    def switch_rows(self, factor: float) -> None:
        """Gyre and the oracle async static split's best point with the switch costs x factor."""
        c = self.cfg.cost
        cost = c.model_copy(update={k: getattr(c, k) * factor for k in SWITCH_COSTS})
        xcfg = self.cfg.model_copy(update={"cost": cost})
        suffix = f" (switch x{factor:g})"
        gyre = self.res.roles.get("gyre")
        if gyre is not None and gyre.policy is not None:
            label = gyre.policy + suffix
            r = self.one(PolicySpec(gyre.policy), self.sc, label, xcfg)
            ok = r is not None and r.reached
            if r is not None:
                self.res.runs[label] = r
            self.res.roles[f"gyre_switch_x{factor:g}"] = RoleResult(
                f"gyre_switch_x{factor:g}", gyre.policy, label if ok else None, missing="" if ok else NOT_RUN
            )
        best = oracle_point(self.res, "oracle_async_static")
        if best is not None:
            role = f"oracle_async_static_switch_x{factor:g}"
            rr = self.fixed(role, best.policy, best.training_cells, best.placement, xcfg, suffix)
            rr.note = f"the x1 oracle's split ({best.label}) rerun, not re-swept"
            self.res.roles[role] = rr

    def at(self, entry: PolicyEntry, name: str) -> RoleResult:
        """One run at the split of another row's oracle."""
        ref = self.res.roles.get(entry.at) if entry.at is not None else None
        best = next((p for p in ref.sweep if p.label == ref.label), None) if ref is not None else None
        if best is None:
            return RoleResult(entry.role, None, None, missing=f"row {entry.at!r} has no oracle to run at")
        label = point_label(name, best.training_cells, best.placement)
        r = self.one(
            PolicySpec(name, training_cells=best.training_cells), _with(self.sc, best.placement), label
        )
        if r is None:
            return RoleResult(entry.role, None, None, missing=NOT_RUN)
        self.res.runs[label] = r
        return RoleResult(
            entry.role, name, label if r.reached else None, missing="" if r.reached else "did not reach N"
        )

    def sweep(self, entry: PolicyEntry, name: str) -> RoleResult:
        sc = self.sc
        cells = sc.cluster.cells
        placements = list(entry.placements) or [sc.cluster.placement]
        coarse = [t for t in (sc.static_training_cells or self.cfg.static_training_cells) if 1 <= t < cells]
        points: list[SweepPoint] = []
        best: SweepPoint | None = None

        def run_point(t: int, where: str) -> None:
            nonlocal best
            label = point_label(name, t, where)
            if label in self.res.runs or any(p.label == label for p in points):
                return
            cutoff = self.cfg.sweep_cutoff
            horizon = (
                best.time_to_n_s * cutoff
                if (cutoff and best is not None and best.time_to_n_s is not None)
                else None
            )
            r = self.one(PolicySpec(name, training_cells=t), _with(sc, where, horizon), label)
            if r is None:
                return
            if r.reached:
                p = SweepPoint(name, t, where, r.time_to_n_s)
                self.res.runs[label] = r
                if best is None or best.time_to_n_s is None or r.time_to_n_s < best.time_to_n_s:
                    best = p
            else:
                p = SweepPoint(name, t, where, None, cut_at_s=horizon)
            points.append(p)

        for t in _middle_out(coarse):
            run_point(t, placements[0])
        for where in placements[1:]:  # the best coarse point and its coarse neighbours
            for t in _neighbours(coarse, best.training_cells) if best is not None else coarse:
                run_point(t, where)
        if best is not None and self.cfg.sweep_refine:
            for t in _refine(coarse, best.training_cells, cells):
                run_point(t, best.placement)
        points.sort(key=lambda p: (p.placement, p.training_cells))
        return RoleResult(
            entry.role,
            name if points else None,
            best.label if best else None,
            missing="" if best else (NOT_RUN if not points else "no sweep point reached N"),
            sweep=points,
        )


def run_scenario(
    cfg: SimConfig,
    sc: ScenarioConfig,
    *,
    variants: bool = True,
    record_every_s: float = 5.0,
    log: Log = print,
) -> ScenarioResult:
    """Every row of ``cfg.policies`` (and, with ``variants``, the what-ifs of the gyre row's
    policy) on scenario ``sc`` at its ``seed``."""
    t0 = time.perf_counter()
    bound, bound_eta, gate = limits(cfg, sc)
    res = ScenarioResult(sc, bound, bound_eta, gate)
    log(
        f"[{sc.name} seed {sc.seed}] T*_eta = {bound_eta.t_star_eta_s:.0f} s (eta {bound_eta.eta}); "
        f"gate path {gate.t_s:.0f} s; one-burst T* = {bound.t_star_s:.0f} s"
    )
    runner = _Runner(cfg, sc, res, record_every_s, log)
    for entry in cfg.policies:
        res.roles[entry.role] = runner.row(entry)
    if cfg.switch_sensitivity is not None:
        runner.switch_rows(cfg.switch_sensitivity)
    gyre = res.roles.get("gyre")
    if variants and gyre is not None and gyre.policy is not None:
        for vname, overrides in cfg.variants.items():
            vcfg, vsc = apply_variant(cfg, sc, overrides)
            r = runner.one(PolicySpec(gyre.policy), vsc, f"{gyre.policy} ({vname})", vcfg)
            if r is not None:
                res.variants[vname] = r
    res.wall_s = time.perf_counter() - t0
    return res


def seeds_of(sc: ScenarioConfig) -> list[int]:
    return list(sc.seeds) or [sc.seed]


def oracle_point(res: ScenarioResult, role: str) -> SweepPoint | None:
    """The best point of a swept row (its oracle), if it has one."""
    rr = res.roles.get(role)
    if rr is None or not rr.label:
        return None
    return next((p for p in rr.sweep if p.label == rr.label), None)


KnownSplits = dict[str, tuple[float, str, str]]
"""Scenario name -> (oracle training share T/cells, placement, where it was measured): the
oracle splits of earlier results, for the prior rows of scenarios run on their own."""


def _prior_split(
    res: ScenarioResult, role: str, results: list[ScenarioResult], known: KnownSplits
) -> tuple[int, str, str] | None:
    """(T, placement, where it comes from) of ``res``'s prior split: the oracle of ``role`` on
    the next seed of the same scenario (cyclically), else on its ``prior_from`` scenario (as a
    share of the cells, from this run or from ``known``)."""
    sc = res.scenario
    cells = sc.cluster.cells
    same = sorted((r for r in results if r.scenario.name == sc.name), key=lambda r: r.scenario.seed)
    if len(same) > 1:
        i = next(i for i, r in enumerate(same) if r is res)
        other = same[(i + 1) % len(same)]
        best = oracle_point(other, role)
        if best is not None:
            return best.training_cells, best.placement, f"seed {other.scenario.seed}'s oracle, {best.label}"
    src = sc.prior_from
    if src is None:
        return None
    near = [r for r in results if r.scenario.name == src]
    near.sort(key=lambda r: (r.scenario.seed != sc.seed, r.scenario.seed))
    for r in near:
        best = oracle_point(r, role)
        if best is not None:
            share, where, label = best.training_cells / r.scenario.cluster.cells, best.placement, best.label
            return _scaled(share, cells), where, f"{src} seed {r.scenario.seed}'s oracle, {label}, scaled"
    if src in known:
        share, where, desc = known[src]
        return _scaled(share, cells), where, f"{src}'s oracle ({desc}), scaled"
    return None


def _scaled(share: float, cells: int) -> int:
    return min(cells - 1, max(1, round(share * cells)))


def _unit(args: tuple[SimConfig, ScenarioConfig, bool]) -> ScenarioResult:
    cfg, sc, variants = args
    return run_scenario(cfg, sc, variants=variants, log=lambda m: print(m, flush=True))


def _one_unit(args: tuple[SimConfig, ScenarioConfig, PolicySpec, str, float]) -> RunResult | None:
    cfg, sc, spec, label, record_every_s = args
    res = ScenarioResult(sc, None, None)  # type: ignore[arg-type]  # only the runner's log needs it
    return _Runner(cfg, sc, res, record_every_s, lambda m: print(m, flush=True)).one(spec, sc, label)


def run_priors(
    cfg: SimConfig,
    results: list[ScenarioResult],
    *,
    jobs: int = 1,
    known: KnownSplits | None = None,
    record_every_s: float = 5.0,
) -> None:
    """Fills the ``prior`` rows of ``results`` (the second pass): each runs at its prior split,
    reusing the seed's own sweep point of that split when it has one."""
    todo: list[tuple[ScenarioResult, str, str, tuple[SimConfig, ScenarioConfig, PolicySpec, str, float]]] = []
    for res in results:
        for entry in cfg.policies:
            if entry.prior is None:
                continue
            ref = res.roles.get(entry.prior)
            split = _prior_split(res, entry.prior, results, known or {})
            if ref is None or ref.policy is None or split is None:
                why = f"no oracle of {entry.prior!r} on another seed or a neighbouring scenario"
                res.roles[entry.role] = RoleResult(entry.role, None, None, missing=why)
                continue
            t, where, note = split
            label = point_label(ref.policy, t, where)
            res.roles[entry.role] = RoleResult(entry.role, ref.policy, None, missing=NOT_RUN, note=note)
            if label in res.runs:
                res.roles[entry.role] = RoleResult(entry.role, ref.policy, label, note=note)
                continue
            spec = PolicySpec(ref.policy, training_cells=t)
            todo.append(
                (res, entry.role, label, (cfg, _with(res.scenario, where), spec, label, record_every_s))
            )
    if jobs <= 1 or len(todo) <= 1:
        runs = [_one_unit(args) for *_, args in todo]
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(_one_unit, [args for *_, args in todo]))
    for (res, role, label, _), r in zip(todo, runs):
        if r is None:
            continue
        res.runs[label] = r
        rr = res.roles[role]
        rr.label, rr.missing = (label, "") if r.reached else (None, "did not reach N")


def run_all(
    cfg: SimConfig,
    scenarios: list[ScenarioConfig],
    *,
    jobs: int = 1,
    log: Log = print,
    known: KnownSplits | None = None,
) -> list[ScenarioResult]:
    """Every scenario on each of its seeds (variants on the first seed only), over ``jobs``
    worker processes, then the prior rows (``run_priors``); results in scenario, then seed
    order."""
    units = [
        (cfg, sc.model_copy(update={"seed": seed}), i == 0)
        for sc in scenarios
        for i, seed in enumerate(seeds_of(sc))
    ]
    if jobs <= 1 or len(units) <= 1:
        results = [run_scenario(c, s, variants=v, log=log) for c, s, v in units]
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_unit, units))
    t0 = time.perf_counter()
    run_priors(cfg, results, jobs=jobs, known=known)
    extra = time.perf_counter() - t0
    for res in results:  # the second pass's wall time, shared out
        res.wall_s += extra / len(results)
    return results


# -- the summary across seeds ------------------------------------------------------------------


def _median(xs: Sequence[float | None]) -> float | None:
    ok = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(ok) if ok else None


def _spread(xs: list[float | None]) -> list[float | None]:
    ok = [x for x in xs if x is not None and math.isfinite(x)]
    return [min(ok), statistics.median(ok), max(ok)] if ok else [None, None, None]


def _time(r: RunResult | None) -> float | None:
    return r.time_to_n_s if r is not None and r.reached else None


def hygiene(r: RunResult) -> dict[str, float]:
    """The issue's hygiene figures of one run: dropped or cancelled groups / dispatched,
    role-switch + reroute/migration GPU-s / all GPU-s, idle shares of both sides, and the
    length bias (mean generated tokens of consumed / of dispatched groups: < 1 means
    over-provision and dropping favour short episodes), and the share of consumed tokens
    generated more than eta versions before their batch (0 under the cancel rule; the
    partial rule's price)."""
    total = r.gpu_s_total or 1.0
    return {
        "dropped_share": r.dropped_share,
        "switch_reroute_gpu_share": (r.role_switch_gpu_s + r.reroute_gpu_s) / total,
        "trainer_idle": r.trainer_idle_ratio,
        "rollout_idle": r.rollout_idle_ratio,
        "length_bias": r.length_bias,
        "beyond_eta_token_share": r.beyond_eta_token_fraction,
    }


def summarize(cfg: SimConfig, results: list[ScenarioResult]) -> dict[str, dict[str, Any]]:
    """``summary`` of cluster.json: per scenario the medians over seeds (with min / median /
    max under ``spread``), what ran in each row, what is missing, hygiene and the target."""
    by_name: dict[str, list[ScenarioResult]] = {}
    for res in results:
        by_name.setdefault(res.scenario.name, []).append(res)
    return {name: _summary_one(cfg, rs) for name, rs in by_name.items()}


def _summary_one(cfg: SimConfig, rs: list[ScenarioResult]) -> dict[str, Any]:
    sc = rs[0].scenario
    gyre = [_time(r.run("gyre")) for r in rs]
    base = {role: [_time(r.run(role)) for r in rs] for role in SUMMARY_ROLES}
    ratios = {
        role: [b / g if (b is not None and g) else None for b, g in zip(ts, gyre)]
        for role, ts in base.items()
    }
    eff = [r.bound_eta.t_star_eta_s / g if g else None for r, g in zip(rs, gyre)]
    eff_old = [r.bound.t_star_s / g if g else None for r, g in zip(rs, gyre)]
    gate_bound = [max(r.bound_eta.t_star_eta_s, r.gate.t_s) if r.gate is not None else None for r in rs]
    eff_gate = [b / g if (b is not None and g) else None for b, g in zip(gate_bound, gyre)]
    hyg = [hygiene(run) for r in rs if (run := r.run("gyre")) is not None]
    hyg_med = {k: _median([h[k] for h in hyg]) for k in (hyg[0] if hyg else {})}
    gyre_runs = [run for r in rs if (run := r.run("gyre")) is not None]
    out: dict[str, Any] = {
        "gyre_s": _median(gyre),
        **{f"{role}_s": _median(base[role]) for role in SUMMARY_ROLES},
        **{f"vs_{role}": _median(ratios[role]) for role in SUMMARY_ROLES},
        "prior_static_from": [
            f"seed {r.scenario.seed}: {rr.note}"
            for r in rs
            if (rr := r.roles.get("prior_static")) and rr.note
        ],
        "oracle_splits": {
            str(r.scenario.seed): [p.training_cells, p.placement, r.scenario.cluster.cells]
            for r in rs
            if (p := oracle_point(r, "oracle_async_static")) is not None
        },
        **_switch_summary(cfg, rs),
        "cells": sc.cluster.cells,
        "decide_ms_p50": _median([run.decide_ms_p50 for run in gyre_runs]),
        "decide_ms_p99": max((run.decide_ms_p99 for run in gyre_runs), default=None),
        "gyre_sim_wall_s": _median([run.sim_wall_s for run in gyre_runs]),
        "scenario_wall_s": _median([r.wall_s for r in rs]),
        "preemptions": _median([run.preemptions for run in gyre_runs]),
        "kv_evictions": _median([run.kv_evictions for run in gyre_runs]),
        "efficiency_t_star_eta": _median(eff),
        "dropped_share": hyg_med.get("dropped_share"),
        "seeds": [r.scenario.seed for r in rs],
        "eta": sc.training.max_staleness,
        "stale_rule": sc.training.stale_rule,
        "t_star_eta_s": _median([r.bound_eta.t_star_eta_s for r in rs]),
        "t_star_one_burst_s": _median([r.bound.t_star_s for r in rs]),
        "efficiency_t_star_one_burst": _median(eff_old),
        "gate_path_s": _median([r.gate.t_s if r.gate is not None else None for r in rs]),
        "efficiency_gate_bound": _median(eff_gate),
        "spread": {
            "gyre_s": _spread(gyre),
            **{f"{role}_s": _spread(ts) for role, ts in base.items()},
            **{f"vs_{role}": _spread(x) for role, x in ratios.items()},
            "decide_ms_p99": _spread([run.decide_ms_p99 for run in gyre_runs]),
            "gyre_sim_wall_s": _spread([run.sim_wall_s for run in gyre_runs]),
            "efficiency_t_star_eta": _spread(eff),
            "efficiency_gate_bound": _spread(eff_gate),
        },
        "ran": {
            role: sorted({rr.label or "" for r in rs if (rr := r.roles.get(role)) is not None and rr.label})
            for role in [p.role for p in cfg.policies]
        },
        "missing": {
            role: rr.missing for role, rr in rs[0].roles.items() if rr.policy is None or not rr.label
        },
        "hygiene": hyg_med,
        "hygiene_met": _hygiene_met(cfg, hyg_med),
    }
    if sc.target is not None:
        got = out.get(f"vs_{sc.target.baseline}")
        met = got is not None and got >= sc.target.ratio
        if sc.target.min_efficiency is not None:
            e = out["efficiency_t_star_eta"]
            met = met and e is not None and e >= sc.target.min_efficiency
        out["target"] = {**sc.target.model_dump(), "measured": got, "met": met}
    return out


def _switch_summary(cfg: SimConfig, rs: list[ScenarioResult]) -> dict[str, Any]:
    """Gyre against the oracle's split with the switch costs x ``switch_sensitivity``."""
    f = cfg.switch_sensitivity
    if f is None:
        return {}
    x = f"switch_x{f:g}"
    gyre = [_time(r.run(f"gyre_{x}")) for r in rs]
    oracle = [_time(r.run(f"oracle_async_static_{x}")) for r in rs]
    return {
        f"gyre_{x}_s": _median(gyre),
        f"oracle_async_static_{x}_s": _median(oracle),
        f"vs_oracle_async_static_{x}": _median([o / g if (o and g) else None for o, g in zip(oracle, gyre)]),
        f"oracle_async_static_{x}_how": "the x1 oracle's best split rerun at x"
        f"{f:g} switch and weight-sync costs (not re-swept: static splits never switch roles)",
    }


def _hygiene_met(cfg: SimConfig, h: dict[str, float | None]) -> dict[str, bool | None]:
    limits_ = cfg.targets.model_dump()
    key = {"switch_reroute_gpu_share": "switch_reroute_share"}
    return {
        k: (None if v is None else v <= limits_[key.get(k, k)])
        for k, v in h.items()
        if key.get(k, k) in limits_
    }
