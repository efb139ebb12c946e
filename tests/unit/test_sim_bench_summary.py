"""The cluster benchmark's output contract on a tiny config: ``bench/cluster.py --config FILE
--out FILE --doc FILE --img DIR`` writes a JSON whose top-level ``summary`` holds, per
scenario, the medians over seeds other tools read; rows whose policy the registry does not
know are reported missing (never replaced); sweeps keep the best point as the oracle."""

from __future__ import annotations

import json
import runpy
import statistics
from pathlib import Path

import yaml

from sim.bench import run_all, run_scenario, summarize
from sim.config import PolicyEntry, SimConfig, TargetConfig
from testkit.sim_rig import small_config

KEYS = {
    "gyre_s",
    "oracle_async_static_s",
    "oracle_bursty_static_s",
    "colocated_s",
    "vs_oracle_async_static",
    "vs_oracle_bursty_static",
    "vs_colocated",
    "efficiency_t_star_eta",
    "efficiency_gate_bound",
    "gate_path_s",
    "dropped_share",
    "seeds",
}


def tiny() -> SimConfig:
    cfg, sc = small_config()
    sc = sc.model_copy(
        update={"seeds": [3, 4], "target": TargetConfig(baseline="oracle_bursty_static", ratio=0.5)}
    )
    return cfg.model_copy(
        update={
            "scenarios": [sc],
            "policies": [
                PolicyEntry(role="gyre", policy=["gyre", "waterlevel"]),
                PolicyEntry(role="colocated", policy=["colocated"]),
                PolicyEntry(role="oracle_bursty_static", policy=["static"], sweep=True),
                PolicyEntry(role="oracle_async_static", policy=["no-such-policy"], sweep=True),
            ],
            "static_training_cells": [2, 4],
            "sweep_cutoff": 1.05,
            "variants": {"KV handoff": ["cost.kv_handoff=true"]},
        }
    )


def test_summary_schema_through_the_cli(tmp_path: Path) -> None:
    cfg = tiny()
    conf = tmp_path / "tiny.yaml"
    conf.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    out, doc, img = tmp_path / "cluster.json", tmp_path / "cluster.md", tmp_path / "img"
    mod = runpy.run_path("bench/cluster.py", run_name="bench_cluster")
    assert (
        mod["main"](
            ["--config", str(conf), "--out", str(out), "--doc", str(doc), "--img", str(img), "--jobs", "2"]
        )
        == 0
    )
    data = json.loads(out.read_text())
    s = data["summary"]["small"]
    assert KEYS <= set(s)
    assert s["seeds"] == [3, 4]
    assert s["gyre_s"] > 0 and s["colocated_s"] > 0 and s["oracle_bursty_static_s"] > 0
    # The missing row is reported as missing, with nulls where it would count.
    assert s["oracle_async_static_s"] is None and s["vs_oracle_async_static"] is None
    assert "oracle_async_static" in s["missing"]
    # Ratios are medians over seeds of baseline time / Gyre time.
    per_seed = data["scenarios"]["small"]
    assert set(per_seed) == {"3", "4"}
    ratios = []
    for seed in ("3", "4"):
        roles, runs = per_seed[seed]["roles"], per_seed[seed]["runs"]
        gyre = runs[roles["gyre"]["label"]]["time_to_n_s"]
        colo = runs[roles["colocated"]["label"]]["time_to_n_s"]
        ratios.append(colo / gyre)
        # The oracle is the best sweep point that reached N.
        sweep = roles["oracle_bursty_static"]["sweep"]
        best = min(p["time_to_n_s"] for p in sweep if p["time_to_n_s"] is not None)
        assert runs[roles["oracle_bursty_static"]["label"]]["time_to_n_s"] == best
    assert s["vs_colocated"] == statistics.median(ratios)
    assert 0 < s["efficiency_t_star_eta"] <= 1
    # The gate bound: the larger of T*_eta and the gate's latency path, per seed.
    gate = [per_seed[seed]["gate_path"]["t_s"] for seed in ("3", "4")]
    assert s["gate_path_s"] == statistics.median(gate)
    assert s["efficiency_t_star_eta"] <= s["efficiency_gate_bound"] <= 1
    assert 0 <= s["dropped_share"] <= 1
    assert set(s["hygiene"]) >= {"dropped_share", "switch_reroute_gpu_share", "trainer_idle", "rollout_idle"}
    assert s["target"]["baseline"] == "oracle_bursty_static" and isinstance(s["target"]["met"], bool)
    # Variants run on the first seed only.
    assert per_seed["3"]["variants"] and not per_seed["4"]["variants"]
    text = doc.read_text()
    assert "### Summary" in text and "### small" in text and "Missing rows" in text
    assert (img / "cluster_small.png").exists()


def test_a_cut_sweep_point_never_hides_the_oracle() -> None:
    cfg = tiny().model_copy(
        update={"variants": {}, "static_training_cells": [1, 2, 3, 4, 6], "sweep_cutoff": 1.01}
    )
    full = run_scenario(cfg.model_copy(update={"sweep_cutoff": None}), cfg.scenarios[0], log=lambda m: None)
    cut = run_scenario(cfg, cfg.scenarios[0], log=lambda m: None)
    assert cut.run("oracle_bursty_static").time_to_n_s == full.run("oracle_bursty_static").time_to_n_s
    sweep = cut.roles["oracle_bursty_static"].sweep
    assert any(p.time_to_n_s is None and p.cut_at_s for p in sweep)  # something was cut


def test_the_run_cache_returns_the_same_runs(tmp_path: Path, monkeypatch) -> None:
    from sim.bench import CACHE_ENV

    cfg = tiny().model_copy(update={"variants": {}, "static_training_cells": [2]})
    sc = cfg.scenarios[0]
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = run_scenario(cfg, sc, log=lambda m: None)
    files = sorted((tmp_path / "cache").glob("*.pkl"))
    assert len(files) == len(first.runs)
    again = run_scenario(cfg, sc, log=lambda m: None)
    assert {k: r.update_times_s for k, r in again.runs.items()} == {
        k: r.update_times_s for k, r in first.runs.items()
    }
    assert sorted((tmp_path / "cache").glob("*.pkl")) == files


def test_the_run_cache_misses_after_a_policy_change(tmp_path: Path, monkeypatch) -> None:
    """A cached run is keyed by the simulator's and the policies' source too: a rerun after
    a policy change recomputes instead of reporting the run of the code before it."""
    import sim.bench as B

    cfg = tiny().model_copy(update={"variants": {}, "static_training_cells": [2]})
    sc = cfg.scenarios[0]
    monkeypatch.setenv(B.CACHE_ENV, str(tmp_path / "cache"))
    run_scenario(cfg, sc, log=lambda m: None)
    before = set((tmp_path / "cache").glob("*.pkl"))
    monkeypatch.setattr(B, "code_digest", lambda gyre=True: "changed-policy")
    run_scenario(cfg, sc, log=lambda m: None)
    after = set((tmp_path / "cache").glob("*.pkl"))
    assert before < after and len(after) == 2 * len(before)


def test_a_change_to_gyre_alone_reruns_only_gyres_runs(tmp_path: Path, monkeypatch) -> None:
    """Gyre's module is read by the gyre policy alone: after a change to it the baselines'
    runs come from the cache and only Gyre's rerun."""
    import sim.bench as B

    cfg = tiny().model_copy(update={"variants": {}, "static_training_cells": [2]})
    sc = cfg.scenarios[0]
    monkeypatch.setenv(B.CACHE_ENV, str(tmp_path / "cache"))
    first = run_scenario(cfg, sc, log=lambda m: None)
    before = set((tmp_path / "cache").glob("*.pkl"))
    real = B.code_digest
    monkeypatch.setattr(B, "code_digest", lambda gyre=True: "changed-gyre" if gyre else real(False))
    run_scenario(cfg, sc, log=lambda m: None)
    new = set((tmp_path / "cache").glob("*.pkl")) - before
    gyre_runs = [k for k in first.runs if k.startswith("gyre")]
    assert gyre_runs and len(new) == len(gyre_runs) < len(first.runs)


def test_merge_keeps_the_scenarios_this_run_did_not_measure(tmp_path: Path) -> None:
    mod = runpy.run_path("bench/cluster.py", run_name="bench_cluster")
    out = tmp_path / "cluster.json"
    first = {
        "benchmark": "cluster",
        "config": "c.yaml",
        "suite": None,
        "overrides": ["a=1"],
        "wall_s": 10.0,
        "summary": {"A64": {"gyre_s": 1.0}, "B64": {"gyre_s": 2.0}},
        "scenarios": {"A64": {"1": {}}, "B64": {"1": {}}},
    }
    out.write_text(json.dumps(first))
    now = dict(first, overrides=["b=2"], wall_s=5.0, summary={"B64": {"gyre_s": 3.0}, "C": {"gyre_s": 4.0}})
    now["scenarios"] = {"B64": {"2": {}}, "C": {"1": {}}}
    merged = mod["merge_results"](out, now)
    assert merged["summary"] == {"A64": {"gyre_s": 1.0}, "B64": {"gyre_s": 3.0}, "C": {"gyre_s": 4.0}}
    assert merged["scenarios"]["B64"] == {"2": {}} and merged["scenarios"]["A64"] == {"1": {}}
    assert [r["overrides"] for r in merged["runs"]] == [["a=1"], ["b=2"]]
    assert merged["runs"][1]["scenarios"] == ["B64", "C"]
    assert mod["merge_results"](tmp_path / "absent.json", now) is now
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "router"}))
    try:
        mod["merge_results"](tmp_path / "other.json", now)
    except SystemExit as e:
        assert "not a cluster benchmark" in str(e)
    else:
        raise AssertionError("merged into another benchmark's file")


def test_baselines_without_hindsight_and_the_switch_sensitivity() -> None:
    """prior static runs at the oracle split of the *other* seed, 50:50 at half the cells, and
    the switch rows rerun Gyre and the oracle's split with the switch costs x5."""
    cfg = tiny().model_copy(
        update={
            "variants": {},
            "static_training_cells": [2, 3, 4, 6],
            "sweep_cutoff": None,
            "switch_sensitivity": 5.0,
            "policies": [
                PolicyEntry(role="gyre", policy=["gyre"]),
                PolicyEntry(role="oracle_async_static", policy=["async-static"], sweep=True),
                PolicyEntry(role="prior_static", policy=["async-static"], prior="oracle_async_static"),
                PolicyEntry(role="half_static", policy=["async-static"], split=0.5),
            ],
        }
    )
    results = run_all(cfg, cfg.scenarios, log=lambda m: None)
    by_seed = {r.scenario.seed: r for r in results}
    for seed, other in ((3, 4), (4, 3)):
        res = by_seed[seed]
        best_other = next(
            p
            for p in by_seed[other].roles["oracle_async_static"].sweep
            if p.label == by_seed[other].roles["oracle_async_static"].label
        )
        assert res.run("prior_static").label == f"async-static T={best_other.training_cells} (scheduler)"
        assert f"seed {other}'s oracle" in res.roles["prior_static"].note
        # The oracle is never slower than a split chosen without hindsight.
        assert res.run("oracle_async_static").time_to_n_s <= res.run("prior_static").time_to_n_s
        assert res.run("half_static").label == "async-static T=4 (scheduler)"
        x5 = res.run("gyre_switch_x5")
        assert x5 is not None and x5.role_switches > 0
        per_switch = x5.role_switch_s / x5.role_switches
        assert 5 * 1.5 <= per_switch <= 5 * 2.0
        assert res.run("oracle_async_static_switch_x5") is not None
    s = summarize(cfg, results)["small"]
    gyre = [by_seed[x].run("gyre").time_to_n_s for x in (3, 4)]
    prior = [by_seed[x].run("prior_static").time_to_n_s for x in (3, 4)]
    assert s["vs_prior_static"] == statistics.median([p / g for p, g in zip(prior, gyre)])
    assert s["vs_half_static"] > 0 and s["vs_oracle_async_static_switch_x5"] > 0
    assert len(s["prior_static_from"]) == 2
    assert s["decide_ms_p99"] >= s["decide_ms_p50"] > 0 and s["gyre_sim_wall_s"] > 0


def test_several_suites_write_one_results_file(tmp_path: Path) -> None:
    """``--suite a --suite b``: each suite with its own overrides, one results file and one
    table; a later suite's prior split comes from an earlier suite's oracle (``prior_from``)."""
    cfg = tiny()
    small = cfg.scenarios[0].model_copy(update={"seeds": [3], "target": None})
    wide = small.model_copy(update={"name": "wide", "prior_from": "small"})
    rows = [
        {"role": "gyre", "policy": ["gyre"]},
        {"role": "oracle_async_static", "policy": ["async-static"], "sweep": True},
        {"role": "prior_static", "policy": ["async-static"], "prior": "oracle_async_static"},
    ]
    data = cfg.model_copy(update={"scenarios": [small, wide], "variants": {}}).model_dump(mode="json")
    data["static_training_cells"] = [2, 4]
    data["suites"] = {
        "first": {"scenarios": ["small"], "overrides": [f"policies={json.dumps(rows)}"]},
        "second": {
            "scenarios": ["wide"],
            "overrides": [f"policies={json.dumps(rows)}", "switch_sensitivity=null"],
        },
    }
    conf = tmp_path / "two.yaml"
    conf.write_text(yaml.safe_dump(data, sort_keys=False))
    out, doc, img = tmp_path / "cluster.json", tmp_path / "cluster.md", tmp_path / "img"
    mod = runpy.run_path("bench/cluster.py", run_name="bench_cluster")
    argv = ["--config", str(conf), "--out", str(out), "--doc", str(doc), "--img", str(img), "--jobs", "1"]
    assert mod["main"]([*argv, "--suite", "first", "--suite", "second"]) == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert set(s) == {"small", "wide"} and result["suite"] == "first+second"
    assert "vs_oracle_async_static_switch_x5" in s["small"]
    assert "vs_oracle_async_static_switch_x5" not in s["wide"]
    assert s["wide"]["prior_static_from"] and "small's oracle" in s["wide"]["prior_static_from"][0]
    text = doc.read_text()
    assert text.index("BEGIN CLUSTER TABLE") < text.index("BEGIN CLUSTER RESULTS")
    assert "| small |" in text and "| wide |" in text


def test_the_headline_keeps_the_switch_column_of_merged_rows() -> None:
    """A suite without the switch rows (the scale suite), merged into a file whose earlier
    rows have them, dropped the column and its target line from the page's table."""
    from sim.report import headline_markdown

    ratios = ("vs_oracle_async_static", "vs_prior_static", "vs_half_static")
    summary = {
        "A64": {
            "gyre_s": 10.0,
            "spread": dict.fromkeys(ratios, [1.0, 1.05, 1.1]),
            "vs_oracle_async_static_switch_x5": 1.04,
        },
        "B256": {"gyre_s": 20.0, "spread": dict.fromkeys(ratios, [1.02, 1.02, 1.02])},
    }
    table = headline_markdown(summary, None)
    assert "switch ×5" in table and "1.04×" in table
    assert "switch" not in headline_markdown({"B256": summary["B256"]}, None)
