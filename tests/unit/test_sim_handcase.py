"""A case whose answer is known by hand: one single-turn execution on a 2-cell cluster
under colocated synchronous training. Its time to the first update and every GPU-second
category follow from the cost model's formulas, computed here independently."""

from __future__ import annotations

import pytest

from sim.config import (
    ClusterConfig,
    CostConfig,
    LogNormal,
    ProfileConfig,
    ScenarioConfig,
    SimConfig,
    TrainingConfig,
)
from sim.driver import PolicySpec, run_policy

P_TOKENS = 1_000  # prompt
N_OUT = 500  # generated tokens
REWARD_S = 3.0


def _config() -> tuple[SimConfig, ScenarioConfig]:
    profile = ProfileConfig(
        name="hand",
        turns=LogNormal(median=1, sigma=0.0),
        initial_prompt_tokens=P_TOKENS,
        output_tokens=LogNormal(median=N_OUT, sigma=0.0),
        observation_tokens=LogNormal(median=1, sigma=0.0),
        tool_latency=[],
        sandbox_start_s=None,
        reward_s=LogNormal(median=REWARD_S, sigma=0.0),
        group_size=1,
    )
    cost = CostConfig(weight_sync_s=0.0)
    cfg = SimConfig(
        profiles={"hand": profile},
        cost=cost,
        variants={},
        scenarios=[ScenarioConfig(name="hand", profile="hand")],
    )
    sc = ScenarioConfig(
        name="hand",
        profile="hand",
        seed=1,
        cluster=ClusterConfig(cells=2, slots_per_cell=4),
        training=TrainingConfig(batch_groups=1, overprovision=0.0, max_staleness=0, updates=1),
    )
    return cfg, sc


def _train_flops(c: CostConfig, tokens: int) -> float:
    """Training FLOPs of one sequence: 6N per token for the update, 2N for the log-prob pass,
    and attention, 4 L d per token and attended token (tokens/2 of them on average), four
    times (forward, backward = 2 forwards, the log-prob forward)."""
    return tokens * 8 * c.n_params + 4 * (4 * c.n_layers * c.d_model) * tokens * (tokens / 2)


def test_colocated_single_execution_by_hand() -> None:
    cfg, sc = _config()
    c = cfg.cost
    bw = c.hbm_eff * c.hbm_bw
    # Prefill of the prompt (no cached prefix): tokens * (2N + 4 L d ctx_avg) / (0.5 FLOPS).
    prefill = P_TOKENS * (2 * c.n_params + 4 * c.n_layers * c.d_model * (P_TOKENS / 2)) / (0.5 * c.flops)
    # Decode alone: step(i) = (weights + kv * ctx_i) / bw + step overhead, ctx growing by one per step
    # (memory-bound here: 2N/(0.5 FLOPS) is far smaller). Fluid form: integral over [0, n].
    decode = N_OUT * (c.weight_bytes / bw + c.decode_step_overhead_s) + c.kv_bytes_per_token / bw * (
        N_OUT * P_TOKENS + N_OUT**2 / 2
    )
    assert 2 * c.n_params / (0.5 * c.flops) < (c.weight_bytes + c.kv_bytes_per_token * P_TOKENS) / bw
    closed_at = prefill + decode + REWARD_S
    # Barrier reached: both cells switch to training (2 s), then train the episode's tokens
    # on 2 cells, then the fixed optimizer cost.
    tokens = P_TOKENS + N_OUT
    train = _train_flops(c, tokens) / (2 * c.flops * c.train_flops_eff)
    t_update = closed_at + c.switch_to_train_s + train + c.train_step_fixed_s

    r = run_policy(cfg, sc, PolicySpec("colocated"))
    assert r.reached
    assert r.time_to_n_s == pytest.approx(t_update, rel=1e-9)
    g = r.gpu_s
    assert g["prefill"] == pytest.approx(prefill, rel=1e-9)
    assert g["decode"] == pytest.approx(decode, rel=1e-9)
    assert g["train"] == pytest.approx(2 * (train + c.train_step_fixed_s), rel=1e-9)
    assert g["role_switch"] == pytest.approx(2 * c.switch_to_train_s, rel=1e-12)
    # One engine idles for the whole rollout, the other while the reward is computed.
    assert g["idle_rollout"] == pytest.approx(closed_at + REWARD_S, rel=1e-9)
    assert g["idle_train"] == pytest.approx(0.0, abs=1e-9)
    assert r.episode_latency_s["p50"] == pytest.approx(closed_at, rel=1e-9)
    # Two moves to training, and both cells start back at the update (burst end).
    assert r.role_switches == 4 and r.reroutes == 0


def test_waterlevel_single_execution_by_hand() -> None:
    """The waterlevel policy with the same trace: the burst drains when its one execution
    closes, so after drain_grace_s (< interval_s) the core moves to train on what is ready;
    it alone trains; the satellite never moves because the core claims the only group."""
    cfg, sc = _config()
    c = cfg.cost
    r_col = run_policy(cfg, sc, PolicySpec("colocated"))
    closed_at = r_col.episode_latency_s["p50"]
    tokens = P_TOKENS + N_OUT
    train1 = _train_flops(c, tokens) / (1 * c.flops * c.train_flops_eff)
    wait = min(cfg.policy.supply_interval_s, cfg.policy.drain_grace_s)
    t_update = closed_at + wait + c.switch_to_train_s + train1 + c.train_step_fixed_s
    r = run_policy(cfg, sc, PolicySpec("waterlevel"))
    assert r.reached
    assert r.time_to_n_s == pytest.approx(t_update, rel=1e-6)
    # The move, and the core's return at the last update (no next burst).
    assert r.role_switches == 2
    assert r.gpu_s["train"] == pytest.approx(train1 + c.train_step_fixed_s, rel=1e-9)
