"""``python -m services.scheduler --config cluster.yaml``: wiring of one scheduler process.

Every scheduler process serves the gRPC APIs and mirrors the cells, their states, the
policy key, the routers and the leader key; one of them wins the election (the others
campaign as standbys and answer harness calls with UNAVAILABLE naming the leader). The
winner rebuilds from etcd and runs the control loop, the finish-report forwarder and the
supply follower. A lost leadership (a stale epoch, or the lease gone in an etcd outage)
makes the process step down: it stops acting at once, forgets what it held, and campaigns
again; whoever wins (maybe itself, with a new epoch) rebuilds from etcd.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

from gyre.errors import GyreError
from gyre.etcd import LeaderElection, PrefixMirror
from gyre.etcd.values import encode_endpoint
from gyre.runtime import Runtime, Services, main
from gyre.v1 import scheduler_pb2_grpc
from services.scheduler.config import SchedulerConfig
from services.scheduler.events import EventLog, Metrics
from services.scheduler.peers import GrpcPeers
from services.scheduler.scheduler import Scheduler
from services.scheduler.servicer import ControlServicer, HarnessServicer
from services.scheduler.store import SchedulerStore
from services.scheduler.tasks import make_task_source

log = logging.getLogger("services.scheduler")

_state: dict[str, Scheduler] = {}
_mirrors: dict[str, PrefixMirror] = {}
HARNESS = "gyre.v1.HarnessService"


async def build(rt: Runtime) -> Services:
    cfg = rt.config
    assert isinstance(cfg, SchedulerConfig)
    metrics = Metrics()
    if cfg.metrics_port:
        metrics.serve(cfg.host, cfg.metrics_port)
    peers = GrpcPeers(cfg, cfg.packer_target, cfg.rpc_timeout_s, cfg.command_timeout_s)
    sched = Scheduler(
        config=cfg,
        store=None,
        peers=peers,
        tasks=make_task_source(cfg.tasks_file, cfg.task_seed, cfg.loop_tasks),
        events=EventLog(cfg.events_kept),
        metrics=metrics,
    )
    _state["scheduler"] = sched
    keys = rt.keys
    mirrors = {
        "cells": PrefixMirror(rt.etcd, keys.cells(), on_change=sched.on_cells),
        "cell_states": PrefixMirror(rt.etcd, keys.cell_states(), on_change=sched.on_cell_states),
        "policy": PrefixMirror(rt.etcd, keys.policy(), on_change=sched.on_policy),
        "routers": PrefixMirror(rt.etcd, keys.services("router"), on_change=sched.on_routers),
        "leader": PrefixMirror(rt.etcd, keys.leader(), on_change=sched.on_leader),
    }
    for name, mirror in mirrors.items():
        rt.supervisor.spawn(f"mirror.{name}", mirror.run())
    _mirrors.update(mirrors)

    async def _close_peers() -> None:
        await sched.stop()
        await peers.close()
        sched.history.close()

    rt.supervisor.on_flush(_close_peers)
    return [
        (HarnessServicer(sched), scheduler_pb2_grpc.add_HarnessServiceServicer_to_server, HARNESS),
        (
            ControlServicer(sched),
            scheduler_pb2_grpc.add_SchedulerControlServicer_to_server,
            "gyre.v1.SchedulerControl",
        ),
    ]


async def _lead_until_lost(sched: Scheduler, rt: Runtime) -> None:
    """Runs the leader's loops until the leadership is lost: deposed (a write or command
    refused for a stale epoch, a newer leader key) or the lease past its renew deadline."""
    loops = [asyncio.create_task(c) for c in (sched.control_loop(), sched.report_loop(), sched.supply_loop())]
    lost = [asyncio.create_task(sched.deposed.wait()), asyncio.create_task(_lease_lost(rt))]
    try:
        done, _ = await asyncio.wait([*loops, *lost], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (*loops, *lost):
            task.cancel()
        await asyncio.gather(*loops, *lost, return_exceptions=True)
    for task in done:  # a loop that failed for any other reason is a bug: end the process
        if (
            task in loops
            and not task.cancelled()
            and task.exception() is not None
            and not sched.deposed.is_set()
        ):
            raise task.exception()  # type: ignore[misc]


async def _lease_lost(rt: Runtime) -> None:
    """Returns once the lease is past its renew deadline (checked often: a leader must
    stop acting before then, and etcd may be unreachable to tell it)."""
    while rt.lease.valid():
        await asyncio.sleep(0.1)


async def after_start(rt: Runtime) -> None:
    sched = _state["scheduler"]
    cfg = rt.config
    assert isinstance(cfg, SchedulerConfig)
    candidate = encode_endpoint(rt.target, instance=rt.instance).decode()
    election = LeaderElection(rt.etcd, rt.keys.leader(), candidate, rt.lease)
    sched.store = SchedulerStore(rt.etcd, rt.keys, election)

    # Readiness: HarnessService is NOT_SERVING on a standby (a load balancer or Kubernetes
    # Service sends harnesses to the leader); SchedulerControl serves on every replica.
    server = rt.server
    assert server is not None
    await server.health.set(HARNESS, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def lead() -> None:
        while True:
            epoch = await election.campaign(poll_s=0.25)
            try:
                await sched.take_over(int(epoch))
            except GyreError as exc:  # etcd went away (or the lease lapsed) mid-rebuild
                log.warning("take-over failed; campaigning again", extra={"error": repr(exc)})
            else:
                await server.health.set(HARNESS, health_pb2.HealthCheckResponse.SERVING)
                log.info("leading", extra={"epoch": int(epoch)})
                await _lead_until_lost(sched, rt)
            await server.health.set(HARNESS, health_pb2.HealthCheckResponse.NOT_SERVING)
            election.step_down()
            tasks = make_task_source(cfg.tasks_file, cfg.task_seed, cfg.loop_tasks)
            await sched.step_down(tasks, {name: dict(m.items) for name, m in _mirrors.items()})
            log.warning("stepped down; campaigning again", extra={"epoch": int(epoch)})

    rt.supervisor.spawn("leadership", lead())


if __name__ == "__main__":
    main("scheduler", SchedulerConfig, build, after_start=after_start)
