"""The simulator's results are pinned: a small scenario of each policy, and the physical
limit, give exactly these numbers on seed 3. Speed-ups of the simulator must not change
them (same seed, same floats). A change of the *mechanism* that changes them on purpose
regenerates the pins: ``PYTHONPATH=. .venv/bin/python tests/unit/test_sim_pinned.py``
prints the new table, which replaces ``PINS`` in the same commit (with the reason)."""

from __future__ import annotations

import hashlib
import json
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
        PolicySpec("waterlevel"), {"cluster": LOADED.model_copy(update={"placement": "least_loaded"})}),
}


def _scenario(label: str) -> tuple[SimConfig, ScenarioConfig, PolicySpec]:
    cfg, sc = small_config()
    spec, update = SPECS[label]
    return cfg, sc.model_copy(update=update), spec


def fingerprint(label: str) -> dict[str, Any]:
    """The numbers of one run that a pure speed-up must leave unchanged (floats by repr)."""
    cfg, sc, spec = _scenario(label)
    r = run_policy(cfg, sc, spec, record_every_s=1.0)
    digest = hashlib.sha256(json.dumps(
        {"series": r.timeseries, "actions": r.actions}, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "time_to_n_s": repr(r.time_to_n_s),
        "update_times_s": [repr(x) for x in r.update_times_s],
        "gpu_s": {k: repr(v) for k, v in sorted(r.gpu_s.items())},
        "counts": [r.role_switches, r.reroutes, r.reroute_recompute_tokens, r.dropped_groups,
                   r.consumed_groups, r.consumed_tokens, r.sealed_batches, r.decisions],
        "latency": {k: repr(v) for k, v in sorted(r.episode_latency_s.items())},
        "series_actions": digest,
    }


def bound_fingerprint() -> dict[str, str]:
    cfg, sc = small_config()
    return {k: repr(v) for k, v in sorted(vars(physical_limit(cfg, sc)).items())}


def all_pins() -> dict[str, Any]:
    return {**{k: fingerprint(k) for k in sorted(SPECS)}, "bound": bound_fingerprint()}


PINS: dict[str, Any] = {
    "colocated": {
        "time_to_n_s": "2008.5523129052397",
        "update_times_s": [
            "500.0788385837786",
            "1416.561360437123",
            "2008.5523129052397"
        ],
        "gpu_s": {
            "decode": "599.5402538024076",
            "idle_rollout": "17266.34550438187",
            "idle_train": "0.0",
            "prefill": "14.56699065101926",
            "role_switch": "72.0",
            "train": "122.218067311862",
            "weight_sync": "2.299999999998886"
        },
        "counts": [
            48,
            0,
            0,
            0,
            24,
            563390,
            0,
            177
        ],
        "latency": {
            "max": "909.0967118721223",
            "p50": "61.41279946796416",
            "p90": "151.0322789447002",
            "p99": "600.0398004159266"
        },
        "series_actions": "8cd0fc7592aa19c9"
    },
    "static T=3": {
        "time_to_n_s": "447.50759161972155",
        "update_times_s": [
            "162.88066865861308",
            "309.10272876814213",
            "447.50759161972155"
        ],
        "gpu_s": {
            "decode": "984.6841178568089",
            "idle_rollout": "1674.4565834033283",
            "idle_train": "1243.6182109417878",
            "prefill": "24.70484845819184",
            "role_switch": "6.0",
            "train": "92.70456391737699",
            "weight_sync": "1.4000000000000001"
        },
        "counts": [
            3,
            0,
            0,
            1,
            24,
            567083,
            0,
            164
        ],
        "latency": {
            "max": "311.41364686602617",
            "p50": "58.67357804721504",
            "p90": "114.1618667057195",
            "p99": "242.03855194496904"
        },
        "series_actions": "f3945a1acad1d2b8"
    },
    "waterlevel": {
        "time_to_n_s": "398.2076002188253",
        "update_times_s": [
            "144.25337415567276",
            "281.40665825598984",
            "398.2076002188253"
        ],
        "gpu_s": {
            "decode": "905.6273140983504",
            "idle_rollout": "2436.1330982307845",
            "idle_train": "117.09749796384249",
            "prefill": "24.704848458191858",
            "role_switch": "13.0",
            "train": "85.5056432182581",
            "weight_sync": "1.8000000000000453"
        },
        "counts": [
            10,
            10,
            0,
            1,
            25,
            602878,
            0,
            179
        ],
        "latency": {
            "max": "311.65668810172946",
            "p50": "59.40999103651775",
            "p90": "114.04356936613304",
            "p99": "241.81994840731267"
        },
        "series_actions": "b88e1146899048ef"
    },
    "waterlevel loaded": {
        "time_to_n_s": "452.53258615855214",
        "update_times_s": [
            "166.2042521563494",
            "312.12972923566224",
            "452.53258615855214"
        ],
        "gpu_s": {
            "decode": "1160.6210277325665",
            "idle_rollout": "2607.0887607740788",
            "idle_train": "177.56799822989836",
            "prefill": "25.21092477304882",
            "role_switch": "16.0",
            "train": "84.7045639173768",
            "weight_sync": "1.6000000000000454"
        },
        "counts": [
            10,
            10,
            14945,
            1,
            24,
            567083,
            0,
            178
        ],
        "latency": {
            "max": "311.4546327999678",
            "p50": "58.67334952239641",
            "p90": "114.14561368012086",
            "p99": "242.11222624111312"
        },
        "series_actions": "bdb16f4dd2270b0b"
    },
    "waterlevel loaded least-loaded": {
        "time_to_n_s": "452.18386902745476",
        "update_times_s": [
            "166.0991527210696",
            "312.16960195275976",
            "452.18386902745476"
        ],
        "gpu_s": {
            "decode": "1198.762374205582",
            "idle_rollout": "2565.3207987958413",
            "idle_train": "177.75580302378427",
            "prefill": "25.5112813045087",
            "role_switch": "16.0",
            "train": "84.7045639173768",
            "weight_sync": "1.6000000000000454"
        },
        "counts": [
            10,
            12,
            24086,
            1,
            24,
            567083,
            0,
            178
        ],
        "latency": {
            "max": "311.0983629766034",
            "p50": "58.300952599122034",
            "p90": "114.11199033501681",
            "p99": "242.0542359019747"
        },
        "series_actions": "0b854fbf9e48c34e"
    },
    "bound": {
        "critical_path_s": "147.79350069323502",
        "prefill_gpu_s": "13.752667111411576",
        "rollout_gpu_s": "140.92948027715556",
        "slowest_needed_group_s": "142.33725715719572",
        "t_star_s": "147.79350069323502",
        "train_gpu_s": "74.9345798064423",
        "work_bound_s": "28.70209089937618"
    }
}


@pytest.mark.parametrize("label", sorted(SPECS))
def test_small_scenario_results_are_pinned(label: str) -> None:
    assert fingerprint(label) == PINS[label]


def test_physical_limit_is_pinned() -> None:
    assert bound_fingerprint() == PINS["bound"]


if __name__ == "__main__":
    print("PINS: dict[str, Any] = " + json.dumps(all_pins(), indent=4))
