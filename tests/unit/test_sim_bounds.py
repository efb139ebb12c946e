"""The lower bounds (sim/bounds.py). T*_eta: the publish-time recursion on cases computed by
hand, and on a small scenario: below every policy's time, never below the work bound, and
no larger when the staleness bound loosens. The gate's latency path: by hand (the gate, the
pool, the cancel-early rule), and on the small scenario below every policy that dispatches
under the gate."""

from __future__ import annotations

import itertools

import pytest

from sim.bounds import gate_path, gate_schedule, limits, physical_limit, publish_times, staleness_limit
from sim.driver import PolicySpec, run_policy
from testkit.sim_rig import small_config


def test_latency_chain_by_hand() -> None:
    # One cell, no rollout work, training = the optimizer step (2 s) only.
    kw = {"tail": [1.0, 1.0], "rollout": [0.0, 0.0], "train": [2.0, 2.0], "cells": 1, "tau_opt": 2.0}
    # eta = 0: batch 1 starts after t_1 = 0 + 10 + 1; then 11 + 20 + 1.
    t, why = publish_times([10.0, 20.0], eta=0, **kw)
    assert t == [11.0, 32.0] and why == ["latency", "latency"]
    # eta = 1: batch 1 may start at t_0: 0 + 20 + 1 = 21 (> t_1 + optimizer = 13).
    t, why = publish_times([10.0, 20.0], eta=1, **kw)
    assert t == [11.0, 21.0] and why == ["latency", "latency"]
    # eta = 1 with a short second group: the optimizer step after t_1 binds (11 + 0 + 2).
    t, why = publish_times([10.0, 0.5], eta=1, **kw)
    assert t == [11.0, 13.0] and why == ["latency", "train"]


def test_work_binds_by_hand() -> None:
    # Two cells, 10 GPU-s of rollout and 4 of training (2 s optimizer) per batch, eta = 1:
    # t_1 = (10 + 4) / 2 = 7, t_2 = 28 / 2 = 14, t_3 = 42 / 2 = 21: the whole work.
    t, why = publish_times([1.0] * 3, [0.5] * 3, [10.0] * 3, [4.0] * 3, cells=2, eta=1, tau_opt=2.0)
    assert t == [7.0, 14.0, 21.0] and why == ["work"] * 3


def test_work_that_cannot_start_before_t_k_binds_by_hand() -> None:
    # eta = 0, one cell: batch 0 waits 10 s for its group (t_1 = 10), so batch 1's 5 GPU-s of
    # rollout and 2 of training all come after t_1: t_2 = 10 + 7 = 17, although all the work
    # (1 + 5 + 2 + 2 = 10 GPU-s) would fit in 10 s from t_0.
    t, why = publish_times([10.0, 0.1], [0.0, 0.0], [1.0, 5.0], [2.0, 2.0], cells=1, eta=0, tau_opt=2.0)
    assert t == [10.0, 17.0] and why == ["latency", "work"]
    # With eta = 1 batch 1's rollout may run before t_1: only its training (2 s) is after it.
    t, _ = publish_times([10.0, 0.1], [0.0, 0.0], [1.0, 5.0], [2.0, 2.0], cells=1, eta=1, tau_opt=2.0)
    assert t == [10.0, 12.0]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        publish_times([1.0], [1.0, 2.0], [1.0], [1.0], cells=1, eta=0, tau_opt=1.0)
    with pytest.raises(ValueError):
        publish_times([1.0], [1.0], [1.0], [1.0], cells=0, eta=0, tau_opt=1.0)


def _with_eta(sc, eta: int):
    return sc.model_copy(update={"training": sc.training.model_copy(update={"max_staleness": eta})})


def test_small_scenario_bound_is_below_every_policy_and_loosens_with_eta() -> None:
    cfg, sc = small_config()
    bounds = [staleness_limit(cfg, _with_eta(sc, eta)).t_star_eta_s for eta in (0, 1, 2, 8)]
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(bounds))
    assert bounds[0] > bounds[-1]  # a tight staleness bound costs latency
    old, eta1, _ = limits(cfg, sc)
    assert old == physical_limit(cfg, sc)
    assert eta1.t_star_eta_s == pytest.approx(bounds[1])
    assert eta1.t_star_eta_s >= eta1.work_bound_s * (1 - 1e-9)
    assert len(eta1.publish_times_s) == sc.training.updates
    for spec in (
        PolicySpec("waterlevel"),
        PolicySpec("colocated"),
        PolicySpec("static", training_cells=3),
        PolicySpec("gyre"),
        PolicySpec("async-static", training_cells=2),
    ):
        r = run_policy(cfg, sc, spec)
        assert r.reached and r.time_to_n_s >= eta1.t_star_eta_s, spec.label


def test_vectorized_episode_costs_match_the_turn_by_turn_ones() -> None:
    from sim.bounds import _episode_costs, _episode_costs_np
    from sim.config import load_config
    from sim.cost import CostModel
    from sim.workload import Trace

    cfg = load_config("bench/cluster.yaml")
    cost = CostModel(cfg.cost)
    for profile, batch in (("A", 48), ("B", 256), ("C", 64)):
        trace = Trace(cfg.profiles[profile], seed=2)
        for task in range(12):
            ep = trace.episode(task, 0)
            assert _episode_costs_np(ep, cost, batch) == pytest.approx(
                _episode_costs(ep, cost, batch), rel=1e-12
            )


def _gate(
    latency, eta: int, extra: int = 0, updates: int = 2, partial: bool = False, limit: int | None = None
):
    return gate_schedule(
        lambda task, u: (latency[task] if task < len(latency) else 10.0, 1.0),
        batch_groups=1,
        extra_groups=extra,
        eta=eta,
        updates=updates,
        cells=1,
        tau_opt=2.0,
        partial=partial,
        partial_max_versions=limit,
    )


def test_gate_path_by_hand() -> None:
    # B = 1, 10 s per group, 1 GPU-s of training, a 2 s optimizer step, one cell.
    # eta = 0: one group at t_0 (ready at 10, t_1 = 10 + 1 + 2), the next only at t_1.
    g = _gate([], eta=0)
    assert g.publish_times_s == (13.0, 26.0) and (g.dispatched, g.cancelled) == (2, 0)
    # eta = 1: two groups at t_0; the second waits in the pool and batch 1 takes it at t_1.
    g = _gate([], eta=1)
    assert g.publish_times_s == (13.0, 16.0) and (g.dispatched, g.cancelled) == (3, 0)
    # X = 1 at eta = 0: the faster of two groups closes batch 0 at 5 s and the other is
    # cancelled then; its replacement waits for t_1 (the batch in progress is full).
    g = _gate([10.0, 5.0], eta=0, extra=1, updates=1)
    assert g.publish_times_s == (8.0,) and (g.dispatched, g.cancelled) == (2, 1)
    with pytest.raises(ValueError):
        _gate([], eta=-1)


def test_gate_path_under_the_partial_rule_by_hand() -> None:
    # X = 1 at eta = 0, groups of 10 s and 5 s. Cancel early: the 10 s group is cancelled at
    # 5 s (batch 0 full, t_1 = 5 + 1 + 2 = 8); batch 1 waits for the two replacements
    # dispatched at t_1 (8 + 10 + 1 + 2 = 21), and the one it does not take is cancelled.
    g = _gate([10.0, 5.0], eta=0, extra=1)
    assert g.publish_times_s == (8.0, 21.0) and (g.dispatched, g.cancelled) == (4, 2)
    # Partial: it is restamped to v1 and goes on; batch 1 takes it at 10 s: 10 + 1 + 2 = 13.
    # Nothing is cancelled; one replacement is dispatched at t_1 (the gate counts it still).
    g = _gate([10.0, 5.0], eta=0, extra=1, partial=True)
    assert g.publish_times_s == (8.0, 13.0) and (g.dispatched, g.cancelled) == (3, 0)
    # Restamped from v0 to v1: one version past its dispatch. A limit of 1 lets it; 0 is cancel.
    assert _gate([10.0, 5.0], eta=0, extra=1, partial=True, limit=1) == g
    assert _gate([10.0, 5.0], eta=0, extra=1, partial=True, limit=0) == _gate([10.0, 5.0], eta=0, extra=1)


def test_small_scenario_gate_path_is_below_every_gated_policy() -> None:
    cfg, sc = small_config()
    paths = [gate_path(cfg, _with_eta(sc, eta)).t_s for eta in (0, 1, 2)]
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(paths)), paths
    g = gate_path(cfg, sc)
    assert len(g.publish_times_s) == sc.training.updates and 0 < g.cancelled < g.dispatched
    for spec in (
        PolicySpec("gyre"),
        PolicySpec("async-static", training_cells=2),
        PolicySpec("async-static", training_cells=4),
        PolicySpec("async-static-lend", training_cells=2),
    ):
        r = run_policy(cfg, sc, spec)
        assert r.reached and r.time_to_n_s >= g.t_s, spec.label
    partial = sc.model_copy(update={"training": sc.training.model_copy(update={"stale_rule": "partial"})})
    g = gate_path(cfg, partial)
    assert g.cancelled < g.dispatched
    for spec in (PolicySpec("gyre"), PolicySpec("async-static", training_cells=2)):
        r = run_policy(cfg, partial, spec)
        assert r.reached and r.time_to_n_s >= g.t_s, spec.label
