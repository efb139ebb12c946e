"""The demo, in a shorter configuration (mock engines, real torch trainers, real etcd and
processes): at least one cell moves to training and back, at least one live execution is
rerouted and its harness still completes normally, the policy version advances, and
dispatched = finished with nothing lost. Trajectories are token-in/token-out (the agent
offers tools and carries the assistant messages back): at least 99% of consecutive turns
are token-consistent, the rest are counted segment breaks, and the packed tokens of every
micro-step equal the lengths of its segments (fewer than training every turn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.demo.runner import DemoOptions, run_demo
from apps.harness.env import EnvConfig

pytestmark = pytest.mark.slow


async def test_short_demo_moves_cells_and_reroutes(tmp_path: Path):
    opts = DemoOptions(
        engine="mock",
        bursts=2,
        run_dir=tmp_path / "demo",
        dashboard_port=0,
        concurrency=24,
        timeout_s=240,
        live=False,
        # Long, uneven episodes so stragglers are still running when the core moves.
        env=EnvConfig(turns_median=3, turns_sigma=0.8, turns_max=10, time_scale=0.2, max_tokens=8),
        config_overrides={
            "cell_agent": {"mock_time_scale": 0.05, "slots": 6},
            "scheduler": {"interval_s": 0.5},
        },
    )
    summary = await run_demo(opts)
    assert summary["outcome"] == "completed", summary
    ex = summary["executions"]
    assert ex["lost"] == 0 and ex["dispatched"] == ex["finished"] > 0
    assert ex["harness_failed"] == 0
    assert summary["transitions_to_training"] >= 1
    assert summary["transitions_to_rollout"] >= 1
    assert summary["reroutes"] >= 1
    assert summary["policy_versions_published"] >= 2
    assert (opts.run_dir / "timeline.png").stat().st_size > 10_000
    t = summary["trajectories"]
    assert t["consecutive_turn_pairs"] > 0, t
    assert t["token_consistent_pairs"] + t["segment_breaks"] == t["consecutive_turn_pairs"]
    assert t["token_consistent_share"] >= 0.99, t
    assert t["emitted_packed_tokens"] > 0 and t["emitted_tokens_match_segments"], t
    assert t["training_tokens_total"] < t["per_turn_tokens_total"], t
