"""Workload traces are a pure function of the seed (the same trace for every policy), follow
the profile's shapes and clips, and apply drift and group-shared factors as configured."""

from __future__ import annotations

import statistics

import pytest

from sim.config import DriftConfig, LogNormal, ProfileConfig, load_config
from sim.workload import Trace

CFG = load_config("bench/cluster.yaml")


def test_same_seed_same_episode_and_seeds_differ() -> None:
    a = Trace(CFG.profiles["A"], seed=7)
    b = Trace(CFG.profiles["A"], seed=7)
    c = Trace(CFG.profiles["A"], seed=8)
    assert a.episode(3, 1) == b.episode(3, 1)
    assert a.episode(3, 1) != c.episode(3, 1)
    # Order of drawing does not matter: episodes are keyed, not streamed.
    _ = [a.episode(i, 0) for i in range(10)]
    assert a.episode(3, 1) == b.episode(3, 1)


def test_profile_a_shapes() -> None:
    t = Trace(CFG.profiles["A"], seed=1)
    eps = [t.episode(i, 0) for i in range(600)]
    turns = [e.turns for e in eps]
    assert min(turns) >= 3 and max(turns) <= 250
    assert 50 <= statistics.median(turns) <= 70
    per_turn = [n for e in eps for n in e.output_tokens]
    assert 130 <= statistics.median(per_turn) <= 170
    obs = [n for e in eps for n in e.prompt_tokens[1:]]
    assert max(obs) <= 8_000
    assert all(e.prompt_tokens[0] == 3_000 for e in eps)
    assert all(len(e.tool_s) == e.turns and e.tool_s[-1] == 0.0 for e in eps)
    assert max(x for e in eps for x in e.tool_s) <= 600.0


def test_profile_b_group_factor_and_clip() -> None:
    t = Trace(CFG.profiles["B"], seed=1)
    groups = [t.group(task) for task in range(200)]
    assert all(len(g) == 16 and all(e.turns == 1 for e in g) for g in groups)
    assert max(e.total_output for g in groups for e in g) <= 28_672
    # A shared per-prompt factor: lengths correlate within a group.
    means = [statistics.fmean(e.total_output for e in g) for g in groups]
    spread_between = statistics.pstdev(means)
    assert spread_between > 1_000


def test_drift_scales_lengths_with_version() -> None:
    drift = DriftConfig(growth_per_version=0.01, jump_at_version=5, jump_factor=1.5)
    assert drift.factor(0) == 1.0
    assert drift.factor(4) == (1.01) ** 4
    assert drift.factor(5) == (1.01) ** 5 * 1.5
    p = ProfileConfig(output_tokens=LogNormal(median=100, sigma=0.0), turns=LogNormal(median=4, sigma=0.0))
    t = Trace(p, seed=1, drift=drift)
    assert t.episode(0, 0, version=0).output_tokens == (100,) * 4
    assert t.episode(0, 0, version=5).output_tokens == (round(100 * 1.01**5 * 1.5),) * 4


def test_total_output_clip_truncates_turns() -> None:
    p = ProfileConfig(
        output_tokens=LogNormal(median=100, sigma=0.0),
        turns=LogNormal(median=10, sigma=0.0),
        max_total_output_tokens=250,
    )
    e = Trace(p, seed=1).episode(0, 0)
    assert e.total_output == 250
    assert e.output_tokens == (100, 100, 50)
    assert len(e.prompt_tokens) == len(e.tool_s) == 3


def test_mixed_trace_draws_each_task_from_one_profile_by_weight() -> None:
    from sim.config import ScenarioConfig
    from sim.workload import MixedTrace, make_trace

    sc = ScenarioConfig(name="mix", profile="A", seed=5, mix={"A": 1.0, "B": 1.0, "C": 2.0})
    cfg = CFG.model_copy(update={"scenarios": [sc]})
    t = make_trace(cfg, sc)
    assert isinstance(t, MixedTrace)
    kinds = [t.kind(task) for task in range(2000)]
    share = [kinds.count(i) / len(kinds) for i in range(3)]
    assert share[0] == pytest.approx(0.25, abs=0.04) and share[2] == pytest.approx(0.5, abs=0.04)
    # Every group has the scenario profile's size; B tasks are single-turn, A tasks are long.
    for task in range(40):
        g = t.group(task)
        assert len(g) == CFG.profiles["A"].group_size
        if kinds[task] == 1:
            assert all(e.turns == 1 for e in g)
    # The same seed gives the same mix and episodes; the plain trace is unchanged by mixing.
    again = make_trace(cfg, sc)
    assert [again.kind(task) for task in range(200)] == kinds[:200]
    assert again.episode(7, 1) == t.episode(7, 1)
    plain = make_trace(cfg, sc.model_copy(update={"mix": {}}))
    assert plain.episode(3, 0) == Trace(CFG.profiles["A"], seed=5).episode(3, 0)


def test_mix_names_known_profiles() -> None:
    from sim.config import ScenarioConfig, SimConfig

    with pytest.raises(ValueError, match="unknown profile"):
        SimConfig(scenarios=[ScenarioConfig(name="x", mix={"A": 1.0, "Z": 1.0})])
