"""Traces follow an execution across processes: a harness's span, the router's span for the
model call and the engine's span in the cell agent share one trace id, and the router's
and the engine's spans carry the execution id (``gyre.execution_id``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apps.launch import Cluster
from gyre.client import HarnessClient

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def spans_in(log: Path) -> list[dict]:
    """The spans a ConsoleSpanExporter wrote among a process's JSON log lines."""
    text = log.read_text()
    decoder = json.JSONDecoder()
    out, i = [], 0
    while (i := text.find("{\n", i)) != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 2
            continue
        if isinstance(obj, dict) and "context" in obj and "attributes" in obj:
            out.append(obj)
        i = end
    return out


async def test_one_trace_from_harness_to_engine(tmp_path: Path):
    from apps.model.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model")
    data = yaml.safe_load((ROOT / "deploy" / "local" / "cluster.yaml").read_text())
    data["cell_agent"].update(
        engine="mock", model_dir=str(model_dir), mock={"time_scale": 0.0}, tracing="console"
    )
    data["router"].update(model_dir=str(model_dir), tracing="console")
    data["scheduler"].update(
        max_bursts=1, policy="rollout_only", batch_size=1, group_size=1, over_provision=0.0
    )
    data.pop("training", None)
    data["launch"]["processes"] = [
        p for p in data["launch"]["processes"] if p.get("name") not in ("cell-1", "cell-2", "dashboard")
    ]
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test-harness")

    cluster = Cluster(config, tmp_path / "run", free_ports=True)
    cluster.start()
    try:
        async with HarnessClient(
            cluster.procs["scheduler"].target, tls_dir=cluster.pki.identity_dir("harness")
        ) as client:
            execution = await client.acquire(wait_s=10)
            assert execution is not None
            with tracer.start_as_current_span("harness.turn") as span:
                trace_id = f"0x{span.get_span_context().trace_id:032x}"
                await execution.chat([{"role": "user", "content": "hello"}], max_tokens=4)
            await execution.finish(reward=0.5)
    finally:
        cluster.stop()  # SIGTERM: each service flushes its batched spans

    logs = cluster.run_dir / "logs"
    router_spans = [s for s in spans_in(logs / "router.log") if s["context"]["trace_id"] == trace_id]
    engine_spans = [
        s
        for name in ("cell-0", "cell-3")
        for s in spans_in(logs / f"{name}.log")
        if s["context"]["trace_id"] == trace_id
    ]
    assert router_spans, "the router's span did not join the harness's trace"
    assert engine_spans, "the engine's span did not join the harness's trace"
    for spans in (router_spans, engine_spans):
        assert any(s["attributes"].get("gyre.execution_id") == execution.execution_id for s in spans)
