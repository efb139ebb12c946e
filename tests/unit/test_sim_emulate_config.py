"""The emulated cluster's wiring: the rendered cluster YAML is accepted by every service's
own config (no unknown or out-of-bounds field), every duration the scheduler waits is the
scenario's divided by the time scale, the mock engines and the trainer carry the scenario's
cost model, and the replay driver maps scheduler tasks to trace episodes deterministically."""

from __future__ import annotations

import pytest

from services.cell_agent.config import CellAgentConfig
from services.cell_agent.training.mock_trainer import MockTrainerSettings
from services.packer.config import PackerConfig
from services.router.config import RouterConfig
from services.scheduler.config import SchedulerConfig
from sim.config import load_config
from sim.cost import CostModel
from sim.emulate import render_config, small_scenario
from sim.emulate_driver import MARKER, ReplayDriver, segment, task_index
from sim.workload import Trace


@pytest.fixture
def scaled():
    cfg = load_config("bench/cluster.yaml")
    return small_scenario(cfg, cfg.scenario("A64"), cells=16, slots=8, batch_groups=8, updates=3)


def test_rendered_sections_are_valid_service_configs(scaled) -> None:
    cfg, sc = scaled
    conf = render_config(cfg, sc, time_scale=10.0, model_dir="/m")
    for cls, name in ((SchedulerConfig, "scheduler"), (RouterConfig, "router"), (PackerConfig, "packer"),
                      (CellAgentConfig, "cell_agent")):
        section = {k: v for k, v in conf[name].items()}
        cls.model_validate(section)  # raises on an unknown or out-of-bounds field
    assert conf["scheduler"]["interval_s"] == pytest.approx(cfg.policy.supply_interval_s / 10)
    assert conf["scheduler"]["drain_grace_s"] == pytest.approx(cfg.policy.drain_grace_s / 10)
    assert conf["scheduler"]["batch_size"] == conf["packer"]["batch_size"] == 8
    assert len([p for p in conf["launch"]["processes"] if p["service"] == "cell_agent"]) == 16
    indexes = [p["set"]["index"] for p in conf["launch"]["processes"] if p["service"] == "cell_agent"]
    assert indexes == list(range(16))


def test_trainer_and_engine_follow_the_cost_model(scaled) -> None:
    cfg, sc = scaled
    conf = render_config(cfg, sc, time_scale=10.0, model_dir="/m")
    settings = MockTrainerSettings(**conf["training"])
    cost = CostModel(cfg.cost)
    tokens = 50_000
    # One cell trains `tokens` in cost.train_s(tokens, 1) minus the fixed step, scaled.
    assert settings.micro_step_s(tokens) == pytest.approx((cost.train_s(tokens, 1) - cfg.cost.train_step_fixed_s) / 10)
    cell = CellAgentConfig.model_validate(conf["cell_agent"])
    assert cell.mock_time_scale == pytest.approx(0.1)
    assert cell.mock_sleep_s == cfg.cost.switch_to_train_s and cell.mock_wake_s == cfg.cost.switch_to_rollout_s
    # The mock's fixed efficiencies (0.8, 0.5) folded in: its decode term equals sim.cost's.
    from services.cell_agent.engines.mock import MockTiming

    mt = MockTiming(n_params=cell.mock_n_params, weight_bytes=cell.mock_weight_bytes,
                    kv_bytes_per_token=cell.mock_kv_bytes_per_token, hbm_bytes_per_s=cell.mock_hbm_bytes_per_s,
                    flops=cell.mock_flops, step_overhead_s=cell.mock_step_overhead_s)
    ctx = [3000, 5000, 800]
    assert mt.step_s([], ctx) == pytest.approx(cost.decode_step_s(3, sum(ctx)))


def test_driver_maps_tasks_and_members_deterministically(scaled) -> None:
    cfg, sc = scaled
    trace = Trace(cfg.profiles[sc.profile], sc.seed, sc.drift)
    d = ReplayDriver(trace, "s:1", "r:1", time_scale=10.0, workers=1)
    assert task_index("task-17") == 17
    got = [d.episode_for("task-3", "g3", 0) for _ in range(3)]
    assert [e.member for e in got] == [0, 1, 2]
    assert got[1] == trace.episode(3, 1, 0)
    seg = segment(5, 9)
    assert seg[0] == MARKER and len(seg) == 5 and all(t >= 3 for t in seg[1:])
    assert segment(0, 1) == []
