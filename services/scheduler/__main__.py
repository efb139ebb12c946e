"""``python -m services.scheduler --config cluster.yaml``: wiring of one scheduler process.

Every scheduler process serves the gRPC APIs and mirrors the cells, their states, the
policy key, the routers and the leader key; one of them wins the election (the others
campaign as standbys and answer harness calls with UNAVAILABLE naming the leader). The
winner rebuilds from etcd and runs the control loop, the finish-report forwarder and the
supply follower. A lost leadership (stale epoch, lost lease) ends the process non-zero.
"""

from __future__ import annotations

import asyncio
import json
import logging

from grpc_health.v1 import health_pb2

from gyre.etcd import LeaderElection, PrefixMirror
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
HARNESS = "gyre.v1.HarnessService"


async def build(rt: Runtime) -> Services:
    cfg = rt.config
    assert isinstance(cfg, SchedulerConfig)
    metrics = Metrics()
    if cfg.metrics_port:
        metrics.serve(cfg.host, cfg.metrics_port)
    peers = GrpcPeers(cfg, cfg.packer_target, cfg.rpc_timeout_s, cfg.command_timeout_s)
    sched = Scheduler(
        cfg, store=None, peers=peers, tasks=make_task_source(cfg.tasks_file, cfg.task_seed, cfg.loop_tasks),
        events=EventLog(cfg.events_kept), metrics=metrics,
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

    async def _close_peers() -> None:
        await sched.stop()
        await peers.close()
        sched.history.close()

    rt.supervisor.on_flush(_close_peers)
    return [
        (HarnessServicer(sched), scheduler_pb2_grpc.add_HarnessServiceServicer_to_server, HARNESS),
        (ControlServicer(sched), scheduler_pb2_grpc.add_SchedulerControlServicer_to_server,
                "gyre.v1.SchedulerControl"),
    ]


async def after_start(rt: Runtime) -> None:
    sched = _state["scheduler"]
    candidate = json.dumps({"instance": rt.instance, "target": rt.target})
    election = LeaderElection(rt.etcd, rt.keys.leader(), candidate, rt.lease)
    sched.store = SchedulerStore(rt.etcd, rt.keys, election)

    # Readiness: HarnessService is NOT_SERVING on a standby (a load balancer or Kubernetes
    # Service sends harnesses to the leader); SchedulerControl serves on every replica.
    assert rt.server is not None
    await rt.server.health.set(HARNESS, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def lead() -> None:
        epoch = await election.campaign(poll_s=0.25)
        await sched.take_over(int(epoch))
        await rt.server.health.set(HARNESS, health_pb2.HealthCheckResponse.SERVING)
        log.info("leading", extra={"epoch": int(epoch)})
        await asyncio.gather(sched.control_loop(), sched.report_loop(), sched.supply_loop())

    rt.supervisor.spawn("leadership", lead())


if __name__ == "__main__":
    main("scheduler", SchedulerConfig, build, after_start=after_start)
