"""Wiring of the router process: ``python -m services.router --config cluster.yaml``."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre.history import History
from gyre.runtime import Runtime, Services, main
from gyre.v1 import router_pb2_grpc
from services.router.calls import CallPolicy
from services.router.config import RouterConfig
from services.router.engine_client import GrpcEngineClient, PackerTurnSink
from services.router.engine_stream import StreamEngineClient
from services.router.failures import FailureReporter, SchedulerReports
from services.router.http_api import OpenAIApi
from services.router.limits import model_context, turn_limit
from services.router.manager import CallManager
from services.router.metrics import RouterCollector
from services.router.metrics import serve as serve_metrics
from services.router.routes import RouteTable
from services.router.servicer import RouterServicer
from services.router.store import RouteStore
from services.router.tokenization import Tokenizer
from services.router.turns import TurnRecorder

log = logging.getLogger(__name__)


async def build(rt: Runtime) -> Services:
    cfg = rt.config
    assert isinstance(cfg, RouterConfig)
    if not cfg.model_dir:
        raise SystemExit("router: model_dir is required (a local directory with the tokenizer)")
    tokenizer = await asyncio.to_thread(Tokenizer.load, cfg.model_dir)
    table = RouteTable()
    store = RouteStore(
        etcd=rt.etcd,
        keys=rt.keys,
        table=table,
        resync_s=cfg.route_resync_s,
        miss_wait_s=cfg.unknown_token_wait_s,
        miss_rate_per_s=cfg.unknown_token_rate_per_s,
        miss_burst=cfg.unknown_token_burst,
    )
    engines = StreamEngineClient(cfg) if cfg.engine_stream else GrpcEngineClient(cfg)
    sink = PackerTurnSink(cfg.packer_target, cfg) if cfg.packer_target else None
    turns = TurnRecorder(
        sink=sink,
        capacity=cfg.turn_buffer,
        senders=cfg.turn_senders,
        retry_max_s=cfg.turn_retry_max_s,
        history=History.of(cfg, svc="router"),
    )
    policy = CallPolicy(
        retry_budget=cfg.retry_budget,
        failover_wait_s=cfg.failover_wait_s,
        engine_idle_timeout_s=cfg.engine_idle_timeout_s,
        abort_timeout_s=cfg.abort_timeout_s,
        kv_handoff=cfg.kv_handoff,
        kv_timeout_s=cfg.kv_timeout_s,
        coalesce_s=cfg.coalesce_ms / 1000.0,
        turn_record_wait_s=cfg.turn_record_wait_s,
        rebuild_wait_s=cfg.rebuild_wait_s,
    )
    reports = SchedulerReports(cfg, lambda: servicer.leader_mirror.items if servicer.leader_mirror else {})
    reporter = FailureReporter(reports.send) if cfg.report_engine_failures else None
    manager = CallManager(
        routes=table, engines=engines, policy=policy, turns=turns, reporter=reporter, turn_source=sink
    )
    context = cfg.max_model_len or model_context(cfg.model_dir)
    limits: dict[str, Any] = dict(
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_tokens_limit=cfg.max_tokens_limit,
        request_timeout_s=cfg.request_timeout_s,
        turn_tokens=turn_limit(cfg.max_turn_tokens, context),
        context_tokens=context,
    )
    servicer = RouterServicer(
        manager=manager,
        store=store,
        turns=turns,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=tokenizer.stop_token_ids,
        move_route_wait_s=cfg.move_route_wait_s,
        max_stream_calls=cfg.max_stream_calls,
        **limits,
    )
    api = OpenAIApi(
        manager=manager,
        tokenizer=tokenizer,
        model_name=cfg.served_model_name or Path(cfg.model_dir).name,
        max_body_bytes=cfg.max_body_bytes,
        default_max_tokens=cfg.default_max_tokens,
        store=store,
        tool_call_parser=cfg.tool_call_parser,
        **limits,
    )

    if cfg.metrics_port:
        serve_metrics(
            cfg.host,
            cfg.metrics_port,
            RouterCollector(manager.stats, turns, lambda: len(table), manager.trajectories),
        )
    rt.supervisor.spawn("routes", store.run())
    if servicer.leader_mirror is not None:
        rt.supervisor.spawn("leader", servicer.leader_mirror.run())
    rt.supervisor.spawn("turns", turns.run())
    # Routes listed before the first call (etcd slow or out while this router starts: it
    # waits as long as the start-up connect does, gyre.runtime.until_etcd_answers).
    await asyncio.wait_for(store.mirror.synced.wait(), max(cfg.etcd_timeout_s * 2, cfg.etcd_start_wait_s))

    if cfg.tracing != "off":  # OpenTelemetry spans for every HTTP request (gRPC is wired in gyre.grpcx)
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        AioHttpServerInstrumentor().instrument()  # patches web.Application: create the app after
    app = api.app()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.http_port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{cfg.advertise_host or cfg.host}:{port}/v1"
    # Before the ready line, so process runners find the HTTP endpoint of a port-0 router.
    print(json.dumps({"router_http": url}), flush=True)
    log.info("http api listening", extra={"url": url})

    async def stop_http() -> None:
        await runner.cleanup()  # stops intake; in-flight handlers get the shutdown timeout

    async def flush() -> None:
        await turns.flush(cfg.grace_s)
        await manager.close()
        await engines.close()
        await reports.close()
        if sink is not None:
            await sink.close()

    rt.supervisor.on_drain(stop_http)
    rt.supervisor.on_flush(flush)
    return [(servicer, router_pb2_grpc.add_RouterServicer_to_server, "gyre.v1.Router")]


if __name__ == "__main__":
    main("router", RouterConfig, build)
