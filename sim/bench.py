"""One benchmark scenario end to end: the physical limit, Gyre (the default policy), the seed's
waterlevel, colocated synchronous, the bursty static split sweep (coarse, then refined around
the best: "oracle bursty static"), the asynchronous static split swept over T and both
placements ("oracle async static"), the async static split that lends idle trainers at the
oracle's T and placement, and what-if variants of Gyre (its ablation levers), all on the
same trace and cell count."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sim.bounds import Bound, physical_limit
from sim.config import ScenarioConfig, SimConfig
from sim.driver import PolicySpec, run_policy
from sim.metrics import RunResult


@dataclass
class ScenarioResult:
    scenario: ScenarioConfig
    bound: Bound
    runs: dict[str, RunResult] = field(default_factory=dict)  # by label
    sweep: list[tuple[int, float]] = field(default_factory=list)  # (T, time to N)
    async_sweep: list[tuple[int, str, float]] = field(default_factory=list)  # (T, placement, time to N)
    variants: dict[str, RunResult] = field(default_factory=dict)  # what-ifs of the main policy
    wall_s: float = 0.0

    @property
    def waterlevel(self) -> RunResult | None:
        return self.runs.get("waterlevel")

    @property
    def gyre(self) -> RunResult | None:
        return self.runs.get("gyre")

    @property
    def main(self) -> RunResult | None:
        """The policy the report is about: Gyre when it ran, else the seed's waterlevel."""
        return self.gyre or self.waterlevel

    @property
    def oracle_async_static(self) -> RunResult | None:
        runs = [r for r in self.runs.values() if r.policy == "async-static" and r.reached]
        return min(runs, key=lambda r: r.time_to_n_s) if runs else None

    @property
    def async_lend(self) -> RunResult | None:
        return next((r for r in self.runs.values() if r.policy == "async-static-lend"), None)

    @property
    def colocated(self) -> RunResult | None:
        return self.runs.get("colocated")

    @property
    def oracle_static(self) -> RunResult | None:
        statics = [r for r in self.runs.values() if r.policy == "static" and r.reached]
        return min(statics, key=lambda r: r.time_to_n_s) if statics else None

    def headline(self) -> dict[str, Any]:
        wl, co, st = self.waterlevel, self.colocated, self.oracle_static
        t_star = self.bound.t_star_s
        out: dict[str, Any] = {"scenario": self.scenario.name, "t_star_s": t_star}
        if wl is not None:
            out["waterlevel_s"] = wl.time_to_n_s
            out["efficiency"] = t_star / wl.time_to_n_s if wl.reached else 0.0
        if wl is not None and co is not None:
            out["speedup_vs_colocated"] = co.time_to_n_s / wl.time_to_n_s
        if wl is not None and st is not None:
            out["oracle_static"] = st.label
            out["speedup_vs_oracle_static"] = st.time_to_n_s / wl.time_to_n_s
        g, oa = self.gyre, self.oracle_async_static
        if g is not None:
            out["gyre_s"] = g.time_to_n_s
            out["gyre_efficiency_t_star"] = t_star / g.time_to_n_s if g.reached else 0.0
            out["gyre_dropped_share"] = g.dropped_share
            if oa is not None:
                out["oracle_async_static"] = oa.label
                out["oracle_async_static_s"] = oa.time_to_n_s
                out["gyre_vs_oracle_async_static"] = oa.time_to_n_s / g.time_to_n_s
            if st is not None:
                out["gyre_vs_oracle_bursty_static"] = st.time_to_n_s / g.time_to_n_s
            if co is not None:
                out["gyre_vs_colocated"] = co.time_to_n_s / g.time_to_n_s
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.model_dump(),
            "headline": self.headline(),
            "bound": vars(self.bound),
            "static_sweep": [{"training_cells": t, "time_to_n_s": s} for t, s in self.sweep],
            "async_static_sweep": [{"training_cells": t, "placement": p, "time_to_n_s": s}
                                   for t, p, s in self.async_sweep],
            "runs": {k: r.to_json(with_series=False) for k, r in self.runs.items()},
            "variants": {k: r.to_json(with_series=False) for k, r in self.variants.items()},
            "wall_s": self.wall_s,
        }


def _refine(coarse: list[int], best: int, cells: int) -> list[int]:
    """Static-split points between the best coarse point and its neighbours."""
    pts = sorted(set(coarse))
    i = pts.index(best)
    out = []
    lo = pts[i - 1] if i > 0 else max(1, best // 2)
    hi = pts[i + 1] if i + 1 < len(pts) else min(cells - 1, best + (best - lo))
    for t in ((lo + best) // 2, (best + hi) // 2):
        if 1 <= t < cells and t not in pts:
            out.append(t)
    return sorted(set(out))


def run_scenario(cfg: SimConfig, sc: ScenarioConfig, *,
                 variants: dict[str, tuple[SimConfig, ScenarioConfig]] | None = None,
                 record_every_s: float = 5.0, log=print) -> ScenarioResult:
    """Runs every policy of ``cfg.policies`` on scenario ``sc``."""
    t0 = time.perf_counter()
    res = ScenarioResult(sc, physical_limit(cfg, sc))
    log(f"[{sc.name}] T* = {res.bound.t_star_s:.0f} s (work {res.bound.work_bound_s:.0f} s, "
        f"critical path {res.bound.critical_path_s:.0f} s)")

    def one(spec: PolicySpec, c: SimConfig = cfg, s: ScenarioConfig = sc, label: str = "") -> RunResult:
        r = run_policy(c, s, spec, record_every_s=record_every_s)
        log(f"[{s.name}] {label or spec.label:16s} time to {s.training.updates} updates "
            f"{r.time_to_n_s:9.0f} s  ({r.events_processed} events, {r.sim_wall_s:.1f} s wall)")
        return r

    if "gyre" in cfg.policies:
        res.runs["gyre"] = one(PolicySpec("gyre"))
    if "waterlevel" in cfg.policies:
        res.runs["waterlevel"] = one(PolicySpec("waterlevel"))
    if "colocated" in cfg.policies:
        res.runs["colocated"] = one(PolicySpec("colocated"))
    if "static" in cfg.policies:
        cells = sc.cluster.cells
        coarse = sorted({t for t in cfg.static_training_cells if 1 <= t < cells})
        times: dict[int, float] = {}
        for t in coarse:
            r = one(PolicySpec("static", training_cells=t))
            res.runs[r.label] = r
            times[t] = r.time_to_n_s
        if times:
            best = min(times, key=times.__getitem__)
            for t in _refine(coarse, best, cells):
                r = one(PolicySpec("static", training_cells=t))
                res.runs[r.label] = r
                times[t] = r.time_to_n_s
        res.sweep = sorted(times.items())
    if "async-static" in cfg.policies:
        _async_sweep(cfg, sc, res, one)
    oa = res.oracle_async_static
    if "async-static-lend" in cfg.policies and oa is not None:
        r = one(PolicySpec("async-static-lend", training_cells=_t_of(oa), placement=_placement_of(oa, sc)))
        res.runs[r.label] = r
    main = "gyre" if "gyre" in cfg.policies else "waterlevel"
    for name, (vcfg, vsc) in (variants or {}).items():
        r = one(PolicySpec(main), vcfg, vsc, label=f"{main} ({name})")
        r.label = f"{main} ({name})"
        res.variants[name] = r
    res.wall_s = time.perf_counter() - t0
    return res


def _t_of(r: RunResult) -> int:
    return int(r.label.split("T=")[1].split(",")[0])


def _placement_of(r: RunResult, sc: ScenarioConfig) -> str:
    return r.label.split(", ")[1] if ", " in r.label else sc.cluster.placement


def _async_sweep(cfg: SimConfig, sc: ScenarioConfig, res: ScenarioResult, one) -> None:
    """AReaL-style async static split over T (coarse, then refined around the best) for each
    placement of ``cfg.async_static_placements``; the best of all is the oracle."""
    cells = sc.cluster.cells
    coarse = sorted({t for t in cfg.static_training_cells if 1 <= t < cells})
    for placement in cfg.async_static_placements:
        times: dict[int, float] = {}
        for t in coarse:
            r = one(PolicySpec("async-static", training_cells=t, placement=placement))
            res.runs[r.label] = r
            times[t] = r.time_to_n_s
        if times:
            best = min(times, key=times.__getitem__)
            for t in _refine(coarse, best, cells):
                r = one(PolicySpec("async-static", training_cells=t, placement=placement))
                res.runs[r.label] = r
                times[t] = r.time_to_n_s
        res.async_sweep += [(t, placement, x) for t, x in sorted(times.items())]
