"""The common start-up and shutdown of a Gyre service process.

Every service's ``__main__`` is: parse ``--config``, build its typed config, and call
:func:`main` with a ``build`` coroutine that wires its domain objects and returns its gRPC
servicers. This module does the rest, the same way for every service: logging and tracing,
the one etcd client, the process lease and its keeper, the gRPC server (health, reflection,
limits), registration under ``/gyre/<cluster>/services/<kind>/``, signal handling, and the
ordered shutdown. A :class:`~gyre.errors.FatalError` exits with status 1.

An etcd outage ends nothing: the lease keeper replaces a lost lease by a new session when
etcd answers again, and the registration is put again with it (services add their own
lease-bound keys with ``rt.lease.on_new_session``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from gyre import config as config_mod
from gyre import heap
from gyre.backoff import Backoff
from gyre.config import ServiceConfig
from gyre.errors import FatalError, Unavailable
from gyre.etcd import Etcd, Keys, LeaseKeeper
from gyre.etcd.client import LeaseNotFound
from gyre.etcd.values import encode_endpoint
from gyre.grpcx.server import GrpcServer, Registrar
from gyre.grpcx.tls import TlsFiles, TlsNotConfigured, set_process_tls
from gyre.supervisor import Supervisor
from gyre.telemetry import setup_logging, setup_tracing

log = logging.getLogger(__name__)
C = TypeVar("C", bound=ServiceConfig)
Services = Sequence[tuple[Any, Registrar, str]]


@dataclasses.dataclass
class Runtime:
    """What a service's ``build`` gets: shared infrastructure of the process."""

    name: str
    instance: str
    config: ServiceConfig
    etcd: Etcd
    lease: LeaseKeeper
    keys: Keys
    supervisor: Supervisor
    server: GrpcServer | None = None
    port: int = 0

    @property
    def target(self) -> str:
        return f"{self.config.advertise_host or self.config.host}:{self.port}"


Build = Callable[[Runtime], Awaitable[Services]]
AfterStart = Callable[[Runtime], Awaitable[None]]
Prepare = Callable[[ServiceConfig], None]


async def until_etcd_answers(etcd: Etcd, lease: LeaseKeeper, wait_s: float) -> None:
    """Connects to etcd and takes the process lease, retrying with back-off while etcd does
    not answer (an outage, or etcd restarting while this process starts) for up to
    ``wait_s``; past it the last error ends the start. Anything but unavailability (a
    refused certificate, a permission) ends it at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    backoff = Backoff(0.2, 2.0)
    while True:
        try:
            await etcd.connect()
            await lease.grant()
            return
        except Unavailable as exc:
            left_s = deadline - loop.time()
            if left_s <= 0:
                raise
            log.warning(
                "etcd does not answer; retrying", extra={"error": str(exc), "left_s": round(left_s, 1)}
            )
            await asyncio.sleep(min(backoff.next(), left_s))


def freeze_startup_heap() -> None:
    """Collects once, then moves every object alive into the collector's permanent
    generation (``gc.freeze``). A process starts with a large heap that lives as long as it
    does (the router's tokenizer and imports: ≈380 K objects), and every full collection
    walked all of it: ≈100 ms of CPU each, a third of a busy router's time. What is
    allocated afterwards is collected as before."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen", extra={"objects": gc.get_freeze_count()})


async def serve(
    name: str, instance: str, cfg: ServiceConfig, build: Build, after_start: AfterStart | None = None
) -> None:
    """Runs one service until a signal or a fatal error."""
    tracer_provider = setup_tracing(name, cfg.tracing, cfg.otlp_endpoint)
    tls = TlsFiles.resolve(cfg.tls, cfg.identity_name())
    set_process_tls(tls)
    etcd = Etcd(cfg.etcd_endpoints, cfg.etcd_timeout_s, tls=tls)
    lease = LeaseKeeper(etcd, cfg.lease_ttl_s)
    await until_etcd_answers(etcd, lease, cfg.etcd_start_wait_s)
    sup = Supervisor(name)
    sup.install_signal_handlers()
    rt = Runtime(name, instance, cfg, etcd, lease, Keys(cfg.cluster_name), sup)
    sup.spawn("lease", lease.run())
    services = await build(rt)
    server = GrpcServer(cfg, services)
    rt.server = server
    rt.port = await server.start()
    registration = encode_endpoint(rt.target, pid=os.getpid())

    async def _register(lease_id: int) -> None:
        await etcd.put(rt.keys.service(name, instance), registration, lease=lease_id)

    lease.on_new_session(_register)
    try:
        await _register(lease.lease_id)
    except LeaseNotFound:  # lapsed during a slow start: the keeper's new session registers
        log.warning("lease lapsed during start-up; registering with the next session")
    if after_start is not None:
        await after_start(rt)
    if cfg.gc_freeze:
        freeze_startup_heap()
    if cfg.heap_profile_s > 0:  # from here: tracing a start-up (a tokenizer's load) slowed it past 120 s
        sup.spawn("heap-profile", heap.log_growth(cfg.heap_profile_s))
    if cfg.heap_trim_s > 0:
        sup.spawn("heap-trim", heap.trim_every(cfg.heap_trim_s))
    log.info("service ready", extra={"service": name, "target": rt.target})
    print(json.dumps({"ready": name, "instance": instance, "target": rt.target}), flush=True)

    async def _stop_intake() -> None:
        await server.set_serving(False)

    async def _drain() -> None:
        await server.stop(cfg.grace_s)

    async def _flush() -> None:
        await lease.revoke()
        await etcd.close()
        if tracer_provider is not None:  # export the spans still batched
            await asyncio.to_thread(tracer_provider.shutdown)

    sup.on_stop_intake(_stop_intake)
    sup.on_drain(_drain)
    sup.on_flush(_flush)
    await sup.run(cfg.grace_s)


def main(
    name: str,
    config_cls: type[C],
    build: Build,
    argv: Sequence[str] | None = None,
    after_start: AfterStart | None = None,
    instance_field: str | None = None,
    prepare: Prepare | None = None,
) -> None:
    """The ``__main__`` of a service: ``python -m services.<name> --config FILE``.

    ``prepare(config)`` runs first, before the process connects to etcd and takes its
    lease: put slow synchronous start-up there (importing vLLM or torch, loading a model).
    Anything that blocks the event loop after the lease is granted delays the lease keeper,
    and a lease that lapses during start-up is replaced by a new session (registrations
    made before it lapsed are put again only if the service registered a session hook)."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    parser.add_argument("--config", default=os.environ.get(config_mod.CONFIG_ENV), help="cluster config YAML")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field"
    )
    args = parser.parse_args(argv)
    overrides = config_mod.parse_set(args.set)
    cfg = config_mod.load(config_cls, args.config, **overrides)
    setup_logging(name, cfg.log_level, cfg.log_json, cfg.log_max_bytes, cfg.log_keep)
    instance = str(getattr(cfg, instance_field)) if instance_field else f"{name}-{os.getpid()}"
    try:  # before the slow start-up: a process without its certificate stops at once
        TlsFiles.resolve(cfg.tls, cfg.identity_name())
    except TlsNotConfigured as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    if prepare is not None:
        prepare(cfg)
    try:
        asyncio.run(serve(name, instance, cfg, build, after_start))
    except FatalError as exc:
        log.error("fatal: %s", exc)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
