"""The GPU cost model matches the arithmetic of docs/design/workloads.md, and the exact integration of a
decode batch's step time agrees with summing the steps one by one (and inverts)."""

from __future__ import annotations

import math

import pytest

from sim.config import CostConfig
from sim.cost import CostModel


@pytest.fixture()
def cost() -> CostModel:
    return CostModel(CostConfig())


def test_long_context_decode_is_kv_bandwidth_bound(cost: CostModel) -> None:
    # docs/design/workloads.md: ~53 concurrent 35k-token sequences, ~1.7k tok/s per GPU, ~32 tok/s each.
    step = cost.decode_step_s(53, 53 * 35_000)
    assert 25 <= 1 / step <= 36
    assert 1_300 <= 53 / step <= 1_900
    # Bytes, not a constant rate: twice the context costs noticeably more per step.
    assert cost.decode_step_s(53, 2 * 53 * 35_000) > 1.7 * step - 0.003


def test_prefill_recompute_of_35k_context(cost: CostModel) -> None:
    # docs/design/workloads.md: recomputing a 35k context takes about 1.6 s on an H200.
    assert 1.2 <= cost.prefill_s(35_000, 0) <= 2.0
    # A cached prefix makes the appended tokens cheap, but attention still reads the prefix.
    appended = cost.prefill_s(400, 35_000)
    assert appended < 0.05
    assert appended > cost.prefill_s(400, 0)


def test_kv_handoff_is_a_fixed_latency_plus_bytes_and_beats_recompute_at_agent_contexts(
    cost: CostModel,
) -> None:
    c = cost.cfg
    assert cost.kv_handoff_s(0) == c.kv_handoff_s
    per_token = c.kv_bytes_per_token / c.kv_handoff_bytes_per_s
    assert cost.kv_handoff_s(35_000) == pytest.approx(c.kv_handoff_s + 35_000 * per_token)
    for ctx in (30_000, 100_000):  # agent contexts: moving the KV is far cheaper than prefill
        assert cost.kv_handoff_s(ctx) < 0.1 * cost.prefill_s(ctx, 0)


def test_train_step_formula(cost: CostModel) -> None:
    c = cost.cfg
    tokens = 1_000_000
    expected = 2.0 + tokens * 6 * c.n_params / (8 * c.flops * 0.35)
    assert cost.train_s(tokens, 8) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "batch,ctx", [(1, 100), (1, 30_000), (48, 48 * 20_000), (256, 256 * 3_000), (400, 10)]
)
def test_integrated_decode_time_equals_sum_of_steps(cost: CostModel, batch: int, ctx: int) -> None:
    rate = cost.decode_rate(batch, ctx)
    n = 2_000
    # Midpoint sum of the per-step times: the fluid model's integral of s(V) over [0, n].
    by_steps = sum(rate.step(v + 0.5) for v in range(n))
    assert rate.time(0.0, n) == pytest.approx(by_steps, rel=1e-6)
    # advance() inverts time(), also across the compute/memory crossover.
    for v0, dt in [(0.0, 0.5), (10.0, 3.0), (100.0, 20.0)]:
        v1 = rate.advance(v0, dt)
        assert rate.time(v0, v1) == pytest.approx(dt, rel=1e-9, abs=1e-12)
        assert v1 > v0 and math.isfinite(v1)
