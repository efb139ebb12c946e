"""The simulator's results are pinned: a small scenario of each policy, and the physical
limit, give these numbers on seed 3 (floats within 1e-9 relative: libm's last bits differ
between CPUs). Speed-ups of the simulator must not change them. A change of the
*mechanism* that changes them on purpose regenerates the pins:
``PYTHONPATH=. .venv/bin/python tests/unit/test_sim_pinned.py`` prints the new table,
which replaces ``PINS`` in the same commit (with the reason)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pytest

from sim.bounds import physical_limit
from sim.config import ClusterConfig, ScenarioConfig, SimConfig
from sim.driver import PolicySpec, run_policy
from testkit.sim_rig import small_config

LOADED = ClusterConfig(cells=8, standalone_cells=1, slots_per_cell=4)
SPECS = {
    "waterlevel": (PolicySpec("waterlevel"), {}),
    "colocated": (PolicySpec("colocated"), {}),
    "static T=3": (PolicySpec("static", training_cells=3), {}),
    # Loaded cells: moves reroute live executions (prefix recompute, homeless executions).
    "waterlevel loaded": (PolicySpec("waterlevel"), {"cluster": LOADED}),
    "waterlevel loaded least-loaded": (
        PolicySpec("waterlevel"),
        {"cluster": LOADED.model_copy(update={"placement": "least_loaded"})},
    ),
    # Overlapping bursts: continuous dispatch, cancel early, PlanMoves, Migrate.
    "gyre": (PolicySpec("gyre"), {}),
    "gyre loaded": (PolicySpec("gyre"), {"cluster": LOADED}),
    "async-static T=3": (PolicySpec("async-static", training_cells=3), {}),
    # Engines whose KV holds 6,000 tokens: admission queue, prefix eviction, recompute preemption.
    "gyre kv-bound": (PolicySpec("gyre"), {}),
}
COSTS: dict[str, dict[str, Any]] = {
    "gyre kv-bound": {"gpu_memory_bytes": (15.2e9 + 4e9 + 6_000 * 57_344) / 0.9},
}
"""Cost overrides of a pinned run (``small_config(**cost)``)."""


def _scenario(label: str) -> tuple[SimConfig, ScenarioConfig, PolicySpec]:
    cfg, sc = small_config(**COSTS.get(label, {}))
    spec, update = SPECS[label]
    return cfg, sc.model_copy(update=update), spec


SIGNIFICANT = 9
"""Digits the digest keeps of each float, and the relative tolerance (1e-9) of the pinned
floats: libm's exp and log differ in the last bit between CPUs (an AMD EPYC and the
machine that made the pins: 1514.3256225833825 against ...823 GPU-s), which no speed-up of
the simulator causes and none should hide behind."""


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.{SIGNIFICANT}g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_rounded(v) for v in x]
    return x


def _same(got: Any, pinned: Any) -> bool:
    """Equal, floats (kept as their repr) within 1e-9 relative."""
    if isinstance(got, dict) and isinstance(pinned, dict):
        return got.keys() == pinned.keys() and all(_same(got[k], pinned[k]) for k in got)
    if isinstance(got, list) and isinstance(pinned, list):
        return len(got) == len(pinned) and all(_same(a, b) for a, b in zip(got, pinned, strict=True))
    if isinstance(got, str) and isinstance(pinned, str) and got != pinned:
        try:
            return math.isclose(float(got), float(pinned), rel_tol=10.0**-SIGNIFICANT)
        except ValueError:
            return False
    return bool(got == pinned)


def fingerprint(label: str) -> dict[str, Any]:
    """The numbers of one run that a pure speed-up must leave unchanged (floats by repr)."""
    cfg, sc, spec = _scenario(label)
    r = run_policy(cfg, sc, spec, record_every_s=1.0)
    digest = hashlib.sha256(
        json.dumps(
            {"series": _rounded(r.timeseries), "actions": _rounded(r.actions)}, sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    return {
        "time_to_n_s": repr(r.time_to_n_s),
        "update_times_s": [repr(x) for x in r.update_times_s],
        "gpu_s": {k: repr(v) for k, v in sorted(r.gpu_s.items())},
        "counts": [
            r.role_switches,
            r.reroutes,
            r.reroute_recompute_tokens,
            r.dropped_groups,
            r.consumed_groups,
            r.consumed_tokens,
            r.sealed_batches,
            r.decisions,
            r.preemptions,
            r.kv_evictions,
            r.kv_recompute_tokens,
        ],
        "latency": {k: repr(v) for k, v in sorted(r.episode_latency_s.items())},
        "series_actions": digest,
    }


def bound_fingerprint() -> dict[str, str]:
    cfg, sc = small_config()
    return {k: repr(v) for k, v in sorted(vars(physical_limit(cfg, sc)).items())}


def all_pins() -> dict[str, Any]:
    return {**{k: fingerprint(k) for k in sorted(SPECS)}, "bound": bound_fingerprint()}


PINS: dict[str, Any] = {
    "async-static T=3": {
        "time_to_n_s": "314.0878619499813",
        "update_times_s": ["143.28508213509096", "190.57007602542822", "314.0878619499813"],
        "gpu_s": {
            "decode": "916.1024472894981",
            "idle_rollout": "940.0032562897553",
            "idle_train": "802.4963719825271",
            "prefill": "27.22146812063448",
            "role_switch": "6.0",
            "train": "133.5672138674169",
            "weight_sync": "1.4000000000000001",
        },
        "counts": [3, 0, 0, 9, 24, 590519, 0, 170, 0, 0, 0],
        "latency": {
            "max": "158.1801712484467",
            "p50": "52.990742433161756",
            "p90": "106.14043759019259",
            "p99": "139.1763640798854",
        },
        "series_actions": "52275c4f627b9e89",
    },
    "colocated": {
        "time_to_n_s": "2007.6346476501274",
        "update_times_s": ["500.55025236941026", "1418.4151453673628", "2007.6346476501274"],
        "gpu_s": {
            "decode": "485.3884220325191",
            "idle_rollout": "17336.543585834468",
            "idle_train": "0.0",
            "prefill": "14.56699065101926",
            "role_switch": "72.0",
            "train": "157.91283033314096",
            "weight_sync": "2.299999999998886",
        },
        "counts": [48, 0, 0, 0, 24, 563390, 0, 177, 0, 0, 0],
        "latency": {
            "max": "908.8754694522576",
            "p50": "58.73146273759028",
            "p90": "148.8045334262321",
            "p99": "596.2733024325872",
        },
        "series_actions": "29d858ec7fb94cd4",
    },
    "gyre": {
        "time_to_n_s": "283.72240375222583",
        "update_times_s": ["118.53006284067254", "171.62508614103456", "283.72240375222583"],
        "gpu_s": {
            "decode": "885.9603117324684",
            "idle_rollout": "1453.921515032675",
            "idle_train": "56.876687526978",
            "prefill": "28.07590561049418",
            "role_switch": "5.5",
            "train": "121.56721386741688",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [3, 12, 8771, 9, 25, 626314, 0, 194, 0, 0, 0],
        "latency": {
            "max": "158.1768186018187",
            "p50": "54.559075849769215",
            "p90": "109.64517187684407",
            "p99": "139.22581916876285",
        },
        "series_actions": "821a9e6dd0558658",
    },
    "gyre kv-bound": {
        "time_to_n_s": "321.4733446236039",
        "update_times_s": ["138.09526205193856", "184.26437071153424", "321.4733446236039"],
        "gpu_s": {
            "decode": "1126.765232318655",
            "idle_rollout": "1496.772136001871",
            "idle_train": "10.621080920003308",
            "prefill": "133.06733676777583",
            "role_switch": "5.5",
            "train": "118.93431560412984",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [3, 3, 8771, 10, 25, 614599, 0, 193, 15, 581, 3080852],
        "latency": {
            "max": "166.05534316723157",
            "p50": "64.74451520121389",
            "p90": "122.16606204796979",
            "p99": "160.5393746080318",
        },
        "series_actions": "bcc1b0b7e8b5ecb0",
    },
    "gyre loaded": {
        "time_to_n_s": "360.2510238555595",
        "update_times_s": ["152.5194337168223", "237.34999037651883", "360.2510238555595"],
        "gpu_s": {
            "decode": "1082.5546618139058",
            "idle_rollout": "2001.9826222990175",
            "idle_train": "0.0",
            "prefill": "28.690596256069103",
            "role_switch": "9.0",
            "train": "118.43133433104308",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [5, 11, 22470, 9, 25, 610698, 0, 213, 0, 0, 0],
        "latency": {
            "max": "176.3732271929026",
            "p50": "54.31794329702416",
            "p90": "111.79903642596132",
            "p99": "150.22166849272318",
        },
        "series_actions": "0451014ae52c3df7",
    },
    "static T=3": {
        "time_to_n_s": "433.71796937870516",
        "update_times_s": ["162.69636755906464", "306.5012943513175", "433.71796937870516"],
        "gpu_s": {
            "decode": "816.807265682732",
            "idle_rollout": "1759.5957021313072",
            "idle_train": "1166.4533805213136",
            "prefill": "24.70484845819184",
            "role_switch": "6.0",
            "train": "128.50052761480185",
            "weight_sync": "1.4000000000000001",
        },
        "counts": [3, 0, 0, 6, 25, 602250, 0, 165, 0, 0, 0],
        "latency": {
            "max": "236.41884417050758",
            "p50": "55.551226021663524",
            "p90": "112.27778360576583",
            "p99": "216.90952233924452",
        },
        "series_actions": "8bbfe07820db57ca",
    },
    "waterlevel": {
        "time_to_n_s": "398.3436671489033",
        "update_times_s": ["141.87348248636783", "275.5733321933221", "398.3436671489033"],
        "gpu_s": {
            "decode": "735.1107188424434",
            "idle_rollout": "2667.1169824880885",
            "idle_train": "29.680634865559156",
            "prefill": "24.704848458191854",
            "role_switch": "9.0",
            "train": "117.87981968584712",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [6, 1, 0, 6, 25, 602878, 0, 178, 0, 0, 0],
        "latency": {
            "max": "236.3904259832345",
            "p50": "56.132438596658226",
            "p90": "112.408684742774",
            "p99": "215.1660030248616",
        },
        "series_actions": "d7bd34b5332c0014",
    },
    "waterlevel loaded": {
        "time_to_n_s": "453.1654874290555",
        "update_times_s": ["167.79562128962877", "311.2933914171413", "453.1654874290555"],
        "gpu_s": {
            "decode": "921.9344948345429",
            "idle_rollout": "2867.503988309514",
            "idle_train": "123.48242244262002",
            "prefill": "25.06861439179765",
            "role_switch": "16.0",
            "train": "122.89986688302496",
            "weight_sync": "1.6000000000000454",
        },
        "counts": [10, 9, 10766, 6, 25, 602250, 0, 183, 0, 0, 0],
        "latency": {
            "max": "236.67184580800637",
            "p50": "55.80608045265949",
            "p90": "113.34328535426309",
            "p99": "215.70096687870455",
        },
        "series_actions": "1f4d97b023c04f74",
    },
    "waterlevel loaded least-loaded": {
        "time_to_n_s": "453.2856676478349",
        "update_times_s": ["167.7254092108955", "311.4141408744438", "453.2856676478349"],
        "gpu_s": {
            "decode": "915.9794220959819",
            "idle_rollout": "2874.211871664812",
            "idle_train": "123.81123379489755",
            "prefill": "25.068614391797645",
            "role_switch": "16.0",
            "train": "122.89986688302496",
            "weight_sync": "1.6000000000000454",
        },
        "counts": [10, 11, 10766, 6, 25, 602250, 0, 183, 0, 0, 0],
        "latency": {
            "max": "236.48860643910257",
            "p50": "55.708902119155596",
            "p90": "113.21540728030675",
            "p99": "215.71575411170238",
        },
        "series_actions": "e70184cf209a0fbb",
    },
    "bound": {
        "critical_path_s": "146.21928907466",
        "prefill_gpu_s": "13.752667111411576",
        "rollout_gpu_s": "107.0825990843817",
        "slowest_needed_group_s": "139.08532502737617",
        "t_star_s": "146.21928907466",
        "train_gpu_s": "106.97633815524637",
        "work_bound_s": "28.476450543879956",
    },
}


@pytest.mark.parametrize("label", sorted(SPECS))
def test_small_scenario_results_are_pinned(label: str) -> None:
    got = fingerprint(label)
    assert _same(got, PINS[label]), (got, PINS[label])


def test_physical_limit_is_pinned() -> None:
    got = bound_fingerprint()
    assert _same(got, PINS["bound"]), (got, PINS["bound"])


if __name__ == "__main__":
    print("PINS: dict[str, Any] = " + json.dumps(all_pins(), indent=4))
