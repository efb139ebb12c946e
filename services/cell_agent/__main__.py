"""Entry point: ``python -m services.cell_agent --config cluster.yaml [--set field=value ...]``.

Wires the engine, the etcd store, the training hook and the servicers; the common runtime
does the rest (lease, gRPC server, signals, ordered shutdown). The engine starts before the
server (after ending whatever a previous incarnation of this cell left running: see
``incarnation.py``; the engine's processes die with this agent), the cell registers and
enters ROLLOUT once the server is up, and a monitor task ends the process (non-zero) when
the engine dies or hangs.
"""

from __future__ import annotations

import asyncio
import importlib
import logging

from gyre.history import History
from gyre.runtime import Runtime, Services, main
from gyre.telemetry import cell_id_var
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from services.cell_agent.cell import Cell, CellIdentity
from services.cell_agent.config import CellAgentConfig
from services.cell_agent.engines import build_engine
from services.cell_agent.engines.vllm_engine import cuda_available
from services.cell_agent.incarnation import Incarnation, default_pid_dir
from services.cell_agent.lifecycle import CellKind
from services.cell_agent.servicer import CellControlServicer, EngineServicer
from services.cell_agent.store import EtcdCellStore
from services.cell_agent.training import build_hook

log = logging.getLogger(__name__)


def _preimport(cfg: CellAgentConfig) -> None:
    """Imports the heavy modules (torch, vLLM, the trainer) in a worker thread: importing
    them on the event loop takes seconds (tens on a loaded machine) during which the lease
    keeper cannot refresh, and the lease lapses before the cell is even up."""
    if cfg.engine == "vllm":
        from services.cell_agent.engines.vllm_engine import apply_vllm_env

        apply_vllm_env()  # before torch is first imported
        importlib.import_module("vllm.v1.engine.async_llm")
    # The trainer (and torch) only for a cell with a training section (build_hook gives the
    # others the no-op hook without importing it): here, off the loop (on the loop it took
    # the 3 s lease of tests/fault/test_cell_crash_only.py).
    if cfg.training is not None:
        importlib.import_module("services.cell_agent.training.hook")


class _App:
    def __init__(self) -> None:
        self.cell: Cell | None = None

    async def build(self, rt: Runtime) -> Services:
        cfg = rt.config
        assert isinstance(cfg, CellAgentConfig)
        cell_id_var.set(cfg.cell_id)
        await asyncio.to_thread(_preimport, cfg)
        kind = CellKind.from_name(cfg.kind)
        identity = CellIdentity(
            cell_id=cfg.cell_id,
            kind=kind,
            index=-1 if kind is CellKind.STANDALONE else cfg.index,
            slots=cfg.slots,
            engine=cfg.engine,
        )
        store = EtcdCellStore(rt.etcd, rt.keys, cfg.cell_id, rt.lease)
        history = History.of(cfg, svc="cell", cell=cfg.cell_id)
        cell = Cell(
            identity,
            build_engine(cfg),
            store,
            drain_wait_s=cfg.drain_wait_s,
            probe_interval_s=cfg.probe_interval_s,
            probe_timeout_s=cfg.probe_timeout_s,
            snapshot_timeout_s=cfg.snapshot_timeout_s,
            history=history,
        )
        cell.hook = build_hook(rt, cfg, history)
        self.cell = cell
        # One incarnation at a time: end what a previous agent of this cell left running,
        # and make the engine processes started from here on die with this agent.
        incarnation = Incarnation(
            cfg.pid_dir or default_pid_dir(cfg.cluster_name), cfg.cell_id, cuda_available()
        )
        await asyncio.to_thread(incarnation.begin)
        await cell.start()
        incarnation.record()

        async def close() -> None:
            await cell.close()
            incarnation.end()
            history.close()

        rt.supervisor.on_flush(close)
        rt.supervisor.spawn("engine-monitor", cell.run())
        if cfg.metrics_port:
            from services.cell_agent.metrics import CellMetrics

            metrics = CellMetrics(cfg.cell_id)
            metrics.serve(cfg.host, cfg.metrics_port)
            rt.supervisor.spawn("metrics", metrics.run(cell))
        engine = EngineServicer(cell, cfg.max_prompt_tokens, cfg.max_tokens_limit)
        # Before the server's drain: the routers' engine streams end once their requests have
        # finished, instead of holding the drain for its whole grace period.
        rt.supervisor.on_stop_intake(engine.drain_streams)
        return [
            (
                engine,
                pb_grpc.add_EngineServicer_to_server,
                "gyre.v1.Engine",
            ),
            (CellControlServicer(cell), pb_grpc.add_CellControlServicer_to_server, "gyre.v1.CellControl"),
            *cell.hook.services(),
        ]

    async def after_start(self, rt: Runtime) -> None:
        assert self.cell is not None
        await self.cell.open(rt.target)


def run(argv: list[str] | None = None) -> None:
    app = _App()
    main(
        "cell_agent",
        CellAgentConfig,
        app.build,
        argv=argv,
        after_start=app.after_start,
        instance_field="cell_id",
    )


if __name__ == "__main__":
    run()
