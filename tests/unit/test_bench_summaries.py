"""The data-plane benchmarks' output contract (issue 20): each saved result carries a
top-level ``summary`` with the fields other tools read, and it agrees with the rows it
summarizes (recomputing it from the saved rows gives the same summary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import dataplane_load, packer_claims, router_latency, scheduler_ledger

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def saved(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


@pytest.mark.parametrize(
    ("name", "summarize", "keys"),
    [
        ("packer_claims", packer_claims.summarize, {"claim_ack_per_s_16"}),
        ("scheduler_ledger", scheduler_ledger.summarize, {"closes_per_s_64"}),
        (
            "router_latency",
            router_latency.summarize,
            {"router_cpu_us_per_token", "ratio_256", "ratio_1024", "routers_per_1000_streams"},
        ),
    ],
)
def test_saved_summary_has_the_contract_fields(name: str, summarize: Any, keys: set[str]) -> None:
    data = saved(name)
    summary = data["summary"]
    assert keys <= set(summary)
    assert summary == summarize(data)
    for k in keys - {"ratio_1024"}:
        assert number(summary[k]), (k, summary[k])
    assert summary.get("ratio_1024") is None or number(summary["ratio_1024"])


def test_router_summary_reports_an_unmeasured_concurrency_as_null() -> None:
    row = {"router_grpc": {"router_cpu_us_per_token": 100.0, "ratio_vs_direct": {"stream_p50": 1.5}}}
    out = {"setup": {"token_delay_s": 0.005}, "concurrency": {"64": row, "256": row}}
    s = router_latency.summarize(out)
    assert s["ratio_256"] == 1.5 and s["ratio_1024"] is None
    assert s["routers_per_1000_streams"] == round(1000 / 256, 2)
    assert s["router_cores_per_1000_streams"] == 20.0  # 100 us x 200 tokens/s x 1,000 streams


def test_scheduler_summary_without_64_harnesses_is_null() -> None:
    s = scheduler_ledger.summarize({"concurrency": {"32": {"scheduler_lifecycles_per_s": 1.0}}})
    assert s["closes_per_s_64"] is None


def test_dataplane_load_summary_agrees_with_its_rows() -> None:
    data = saved("dataplane_load")
    summary = data["summary"]
    assert summary == dataplane_load.summarize(data)
    for k in ("routed_tokens_per_s", "direct_tokens_per_s", "routers", "executions"):
        assert number(summary[k]), (k, summary[k])
    assert set(summary["cpu_us_per_token"]) >= {"router", "cell_agent", "packer"}
    assert summary["turns_lost"] == data["turns_expected"] - data["turns_recorded"]


def test_engine_stream_mux_summary_is_the_median_of_its_rounds() -> None:
    data = saved("engine_stream_mux")
    rounds = data["reader_cpu_us_per_token"]
    for mode in ("per_call", "per_step"):
        got = data["summary"][f"{mode}_stream_us_per_token"]
        assert min(rounds[mode]) <= got <= max(rounds[mode])
