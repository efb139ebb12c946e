"""Wiring of the standalone dashboard: ``python -m services.dashboard``.

    python -m services.dashboard --scheduler 127.0.0.1:50051 --port 8080
    python -m services.dashboard --config cluster.yaml [--set field=value ...]

Unlike the core services it holds no etcd lease and serves no gRPC: it polls the
scheduler and serves HTTP. It prints the same ready line (``{"ready": "dashboard", ...}``)
and stops cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from gyre import config as config_mod
from gyre.grpcx.tls import TlsFiles, TlsNotConfigured, set_process_tls
from gyre.telemetry import setup_logging
from services.dashboard.app import DashboardApp
from services.dashboard.config import DashboardConfig
from services.dashboard.source import GrpcEventSource, GrpcStatusSource

log = logging.getLogger("services.dashboard")


def parse_args(argv: Sequence[str] | None = None) -> DashboardConfig:
    parser = argparse.ArgumentParser(prog="python -m services.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get(config_mod.CONFIG_ENV), help="cluster config YAML")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field"
    )
    parser.add_argument("--scheduler", help="scheduler gRPC target (scheduler_target)")
    parser.add_argument("--port", type=int, help="HTTP port (http_port)")
    parser.add_argument("--host", help="address to bind (host)")
    args = parser.parse_args(argv)
    overrides = config_mod.parse_set(args.set)
    if args.scheduler:
        overrides["scheduler_target"] = args.scheduler
    if args.port is not None:
        overrides["http_port"] = args.port
    if args.host:
        overrides["host"] = args.host
    return config_mod.load(DashboardConfig, args.config, **overrides)


async def serve(cfg: DashboardConfig) -> None:
    source = GrpcStatusSource(cfg.scheduler_target, cfg, cfg.poll_timeout_s)
    dashboard = DashboardApp(
        source,
        poll_interval_s=cfg.poll_interval_s,
        poll_timeout_s=cfg.poll_timeout_s,
        max_samples=cfg.max_samples,
        title=f"Gyre · {cfg.cluster_name}",
        events_source=GrpcEventSource(cfg.scheduler_target, cfg) if cfg.watch_events else None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    runner, port = await dashboard.start(cfg.host, cfg.http_port)
    target = f"{cfg.advertise_host or cfg.host}:{port}"
    log.info("dashboard ready", extra={"target": target, "scheduler": cfg.scheduler_target})
    print(json.dumps({"ready": "dashboard", "target": target, "url": f"http://{target}/"}), flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await source.close()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    setup_logging("dashboard", cfg.log_level, cfg.log_json, cfg.log_max_bytes, cfg.log_keep)
    try:  # it dials the scheduler with mTLS as the dashboard: no certificate, no start
        set_process_tls(TlsFiles.resolve(cfg.tls, cfg.identity_name()))
    except TlsNotConfigured as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
