"""The calibrated cost model (issue 33): KV capacity per cell from the GPU's memory and the
model's shapes, the engine's admission, prefix eviction and recompute preemption when the KV
is full, and the training cost with the log-prob pass and attention."""

from __future__ import annotations

import pytest

from sim.cluster import ExecState
from sim.config import CostConfig, SimConfig
from sim.cost import CostModel
from sim.driver import PolicySpec, run_policy
from testkit.sim_rig import CheckingDriver, small_config


def test_kv_capacity_follows_the_gpu_and_the_model() -> None:
    h200, h100 = CostConfig(gpu="h200"), CostConfig(gpu="h100")
    # Qwen2.5-7B: 28 layers x 4 KV heads x 128 x (K, V) x bf16.
    assert h200.kv_bytes_per_token == 28 * 4 * 128 * 2 * 2 == 57_344
    # (0.9 x memory - 4 GB reserve - 15.2 GB weights) / 57,344 B: ~1.88 M and ~0.92 M tokens,
    # about 42 and 21 agents at 44.5k tokens of context.
    assert h200.kv_capacity_tokens == pytest.approx(1.878e6, rel=0.01)
    assert h100.kv_capacity_tokens == pytest.approx(0.921e6, rel=0.01)
    assert h100.hbm_bw == 3.35e12 and h200.hbm_bw == 4.8e12
    # Two GPUs per cell: twice the memory, the weights once.
    two = CostConfig(gpu="h100", gpus_per_cell=2)
    assert two.kv_capacity_tokens > 2 * h100.kv_capacity_tokens
    assert CostConfig(kv_capacity=False).kv_capacity_tokens == float("inf")
    # The preset is authoritative: a what-if on a dumped config switches the hardware.
    dumped = h200.model_dump() | {"gpu": "h100"}
    assert CostConfig.model_validate(dumped).kv_capacity_tokens == h100.kv_capacity_tokens
    with pytest.raises(ValueError, match="disagrees"):
        CostConfig(kv_bytes_per_token=131072)


def _tight(capacity_tokens: int) -> tuple[SimConfig, object]:
    """The small scenario on engines whose KV holds ``capacity_tokens``."""
    cfg, sc = small_config()
    mem = (cfg.cost.weight_bytes + cfg.cost.activation_bytes + capacity_tokens * 57_344) / 0.9
    cost = CostConfig.model_validate(cfg.cost.model_dump() | {"gpu": None, "gpu_memory_bytes": mem})
    assert cost.kv_capacity_tokens == pytest.approx(capacity_tokens)
    return cfg.model_copy(update={"cost": cost}), sc


class KvCheckingDriver(CheckingDriver):
    """The conservation invariants, plus: no engine runs more KV than it holds (but a lone
    sequence), the queue and the cache hold only executions routed there."""

    peak_waiting = 0

    def boundary(self) -> None:
        super().boundary()
        for c in self.cluster.cells:
            eng = c.engine
            if len(eng.active) > 1:
                assert eng.running_tokens() <= eng.cap + 1e-6 * eng.cap
            for ex in eng.waiting:
                assert ex.waiting and ex.cell is c and ex.xid not in eng.active
                assert ex.state is ExecState.GPU
            assert set(eng.cached) <= set(c.execs)
            assert eng.cached_total == sum(eng.cached.values())
            KvCheckingDriver.peak_waiting = max(KvCheckingDriver.peak_waiting, len(eng.waiting))


@pytest.mark.parametrize(
    "spec", [PolicySpec("gyre"), PolicySpec("async-static", training_cells=3)], ids=lambda s: s.label
)
def test_full_kv_preempts_evicts_and_recomputes(spec: PolicySpec) -> None:
    cfg, sc = _tight(6_000)
    KvCheckingDriver.peak_waiting = 0
    r = KvCheckingDriver(cfg, sc, spec).run()
    assert r.reached
    assert r.preemptions > 0 and r.kv_evictions > 0 and KvCheckingDriver.peak_waiting > 0
    assert r.kv_recompute_tokens > 0 and 0 < r.kv_recompute_gpu_s < r.gpu_s["prefill"]
    assert r.gpu_s_total == pytest.approx(r.cell_seconds, rel=1e-9)
    # The same run with unlimited KV: nothing preempted or evicted, and it is faster.
    cfg_free = cfg.model_copy(update={"cost": cfg.cost.model_copy(update={"kv_capacity": False})})
    free = run_policy(cfg_free, sc, spec)
    assert free.preemptions == free.kv_evictions == free.kv_recompute_tokens == 0
    assert free.time_to_n_s < r.time_to_n_s


def test_the_default_h200_holds_the_small_scenario() -> None:
    cfg, sc = small_config()
    r = run_policy(cfg, sc, PolicySpec("gyre"))
    assert r.preemptions == r.kv_evictions == 0


def test_training_cost_includes_the_logprob_pass_and_attention() -> None:
    cost = CostModel(CostConfig())
    bare = CostModel(CostConfig(train_logprob_pass=False, train_attention=False))
    assert bare.train_work_tokens(44_500) == pytest.approx(44_500)
    # 6N + 2N, plus attention: about 1.5x the 6N count at 8k tokens, about 2.1x at 44.5k.
    assert cost.train_work_tokens(1_000) / 1_000 == pytest.approx(8 / 6, rel=0.02)
    assert 1.4 <= cost.train_work_tokens(8_000) / 8_000 <= 1.55
    assert 1.9 <= cost.train_work_tokens(44_500) / 44_500 <= 2.2
    only_attention = CostModel(CostConfig(train_logprob_pass=False))
    assert 1.0 < only_attention.train_work_tokens(44_500) / 44_500 < 1.7


def test_a_run_trains_at_the_calibrated_cost() -> None:
    cfg, sc = small_config()
    bare_cost = cfg.cost.model_copy(update={"train_logprob_pass": False, "train_attention": False})
    spec = PolicySpec("async-static", training_cells=3)
    r = run_policy(cfg, sc, spec)
    bare = run_policy(cfg.model_copy(update={"cost": bare_cost}), sc, spec)
    # The training GPU-s per consumed token rises by at least the log-prob pass (8N / 6N).
    per_token = r.gpu_s["train"] / r.consumed_tokens
    per_token_bare = bare.gpu_s["train"] / bare.consumed_tokens
    assert per_token > 1.3 * per_token_bare


def test_gyre_sees_the_kv_size_and_the_measured_context() -> None:
    """The driver hands Gyre what the live scheduler would measure: one engine's KV in tokens
    and the mean context of the launched, open executions (sampled every 10 s), and the
    share of rollout time spent recomputing evicted prefixes; the baselines get no context
    (they do not read it)."""
    cfg, sc = _tight(6_000)
    seen: list[tuple[float, float, float]] = []

    class Watching(KvCheckingDriver):
        def snapshot(self):  # type: ignore[no-untyped-def]
            snap = super().snapshot()
            if snap.pipeline is not None:
                p = snap.pipeline
                seen.append((p.kv_tokens_per_cell, p.context_tokens, p.kv_recompute_share))
            return snap

    assert Watching(cfg, sc, PolicySpec("gyre")).run().reached
    assert all(kv == pytest.approx(6_000) for kv, *_ in seen)
    contexts = [ctx for _, ctx, _ in seen if ctx > 0]
    assert contexts and max(contexts) < 6_000 * 4  # a mean context, not a sum
    shares = [share for *_, share in seen]
    assert max(shares) > 0 and all(0 <= share < 1 for share in shares)  # this KV evicts
    seen.clear()
    Watching(cfg, sc, PolicySpec("async-static", training_cells=3)).run()
    assert seen and all(ctx == 0 for _, ctx, _ in seen)
