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
from tests.unit.test_sim_conservation import small_config

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
}


def _scenario(label: str) -> tuple[SimConfig, ScenarioConfig, PolicySpec]:
    cfg, sc = small_config()
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
        "time_to_n_s": "323.96776435719454",
        "update_times_s": ["148.906900037297", "196.76272388822105", "323.96776435719454"],
        "gpu_s": {
            "decode": "1093.1520848581777",
            "idle_rollout": "822.4791037554664",
            "idle_train": "869.9113924504653",
            "prefill": "26.975397529523363",
            "role_switch": "6.0",
            "train": "95.79190062111826",
            "weight_sync": "1.4000000000000001",
        },
        "counts": [3, 0, 0, 9, 24, 590519, 0, 169],
        "latency": {
            "max": "159.26902515146298",
            "p50": "55.611402151571326",
            "p90": "111.31589595930808",
            "p99": "144.2312377042067",
        },
        "series_actions": "a5c96da98ce14aec",
    },
    "colocated": {
        "time_to_n_s": "2008.5523129052397",
        "update_times_s": ["500.0788385837786", "1416.561360437123", "2008.5523129052397"],
        "gpu_s": {
            "decode": "599.5402538024076",
            "idle_rollout": "17266.34550438187",
            "idle_train": "0.0",
            "prefill": "14.56699065101926",
            "role_switch": "72.0",
            "train": "122.218067311862",
            "weight_sync": "2.299999999998886",
        },
        "counts": [48, 0, 0, 0, 24, 563390, 0, 177],
        "latency": {
            "max": "909.0967118721223",
            "p50": "61.41279946796416",
            "p90": "151.0322789447002",
            "p99": "600.0398004159266",
        },
        "series_actions": "5829d759362c572a",
    },
    "gyre": {
        "time_to_n_s": "280.43168912682",
        "update_times_s": ["119.43024987678542", "166.12351423990413", "280.43168912682"],
        "gpu_s": {
            "decode": "1101.5708726823668",
            "idle_rollout": "1216.0694847442292",
            "idle_train": "80.23160690888803",
            "prefill": "28.121337184777833",
            "role_switch": "12.5",
            "train": "83.79190062111797",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [7, 19, 15037, 9, 25, 626314, 0, 218],
        "latency": {
            "max": "159.28858371845388",
            "p50": "57.54496385411329",
            "p90": "112.21226901938913",
            "p99": "144.22079609095186",
        },
        "series_actions": "57b08e50d1e0d41b",
    },
    "gyre loaded": {
        "time_to_n_s": "339.51397034398354",
        "update_times_s": ["150.33175334050105", "210.98636410938423", "339.51397034398354"],
        "gpu_s": {
            "decode": "1305.175924101542",
            "idle_rollout": "1594.9054392578262",
            "idle_train": "32.47432483949446",
            "prefill": "28.26548097961234",
            "role_switch": "12.5",
            "train": "80.7045639173768",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [8, 15, 33968, 9, 24, 567083, 0, 204],
        "latency": {
            "max": "177.48377860093717",
            "p50": "56.51596112287814",
            "p90": "112.83433582642718",
            "p99": "153.98750582394462",
        },
        "series_actions": "bd4e4c69f271a9b5",
    },
    "static T=3": {
        "time_to_n_s": "440.5767102215117",
        "update_times_s": ["162.88066865861308", "309.10272876814213", "440.5767102215117"],
        "gpu_s": {
            "decode": "994.5087349320648",
            "idle_rollout": "1623.0466779388134",
            "idle_train": "1222.825566747158",
            "prefill": "24.70484845819184",
            "role_switch": "6.0",
            "train": "92.70456391737699",
            "weight_sync": "1.4000000000000001",
        },
        "counts": [3, 0, 0, 6, 25, 602250, 0, 164],
        "latency": {
            "max": "243.15327499584967",
            "p50": "58.67357804721504",
            "p90": "114.197549172901",
            "p99": "221.9288598385886",
        },
        "series_actions": "ae3cbb93d2b6c63c",
    },
    "waterlevel": {
        "time_to_n_s": "403.1266482522085",
        "update_times_s": ["144.25337415567276", "281.40665825598984", "403.1266482522085"],
        "gpu_s": {
            "decode": "891.683727201394",
            "idle_rollout": "2554.963749822186",
            "idle_train": "64.68186556984709",
            "prefill": "24.704848458191854",
            "role_switch": "9.0",
            "train": "81.50564321825787",
            "weight_sync": "1.5999999999999999",
        },
        "counts": [6, 1, 0, 6, 25, 602878, 0, 174],
        "latency": {
            "max": "243.09019955534222",
            "p50": "58.993877588124256",
            "p90": "113.87463406967714",
            "p99": "220.56360312909172",
        },
        "series_actions": "f1615a0973fc71f8",
    },
    "waterlevel loaded": {
        "time_to_n_s": "447.0184892016676",
        "update_times_s": ["166.2042521563494", "312.12972923566224", "447.0184892016676"],
        "gpu_s": {
            "decode": "1158.6705479351037",
            "idle_rollout": "2584.4860503327477",
            "idle_train": "151.98893148327113",
            "prefill": "25.716309146509076",
            "role_switch": "16.0",
            "train": "84.7045639173768",
            "weight_sync": "1.6000000000000454",
        },
        "counts": [10, 11, 28838, 6, 25, 602250, 0, 179],
        "latency": {
            "max": "243.35623094517396",
            "p50": "58.77763009490505",
            "p90": "113.84025574863507",
            "p99": "221.15962270600346",
        },
        "series_actions": "eba8dcbcc2d31b78",
    },
    "waterlevel loaded least-loaded": {
        "time_to_n_s": "446.62100736565645",
        "update_times_s": ["166.0991527210696", "312.16960195275976", "446.62100736565645"],
        "gpu_s": {
            "decode": "1189.8596230663886",
            "idle_rollout": "2549.602131907127",
            "idle_train": "151.8967507210054",
            "prefill": "25.925996679010627",
            "role_switch": "16.0",
            "train": "84.7045639173768",
            "weight_sync": "1.6000000000000454",
        },
        "counts": [10, 13, 35136, 6, 25, 602250, 0, 179],
        "latency": {
            "max": "243.27001490651512",
            "p50": "58.50330642438148",
            "p90": "113.82344407608305",
            "p99": "221.1357294005286",
        },
        "series_actions": "1c601db4389d6c66",
    },
    "bound": {
        "critical_path_s": "147.79350069323502",
        "prefill_gpu_s": "13.752667111411576",
        "rollout_gpu_s": "140.92948027715556",
        "slowest_needed_group_s": "142.33725715719572",
        "t_star_s": "147.79350069323502",
        "train_gpu_s": "74.9345798064423",
        "work_bound_s": "28.70209089937618",
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
