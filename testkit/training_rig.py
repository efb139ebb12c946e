"""Trainer cells as the training benchmarks and tests run them: their cluster config
(:func:`trainer_config`), their processes (:func:`trainer_cell`, :func:`trainer_cells`), and
what they send as the scheduler would: ``JoinBatch`` to a trainer (over a channel opened
with the scheduler's identity)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from apps.procs import ServiceProcess
from gyre.ports import free_port
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2 as cpb

STARTING = "still starting"
"""What a trainer's UNAVAILABLE says while its prefix groups are not formed yet."""


def trainer_config(
    cluster: dict[str, Any], model_dir: str | Path, world_size: int, **training: Any
) -> dict[str, Any]:
    """The config of ``world_size`` trainer cells on the model at ``model_dir`` (``cluster``
    its ``cluster`` section): their groups meet on a free loopback port, ``training`` (the
    rest of ``trainer_cell.training``) on top."""
    return {
        "cluster": cluster,
        "trainer_cell": {
            "training": {
                "model_dir": str(model_dir),
                "world_size": world_size,
                "dist_master": f"127.0.0.1:{free_port()}",
                **training,
            }
        },
    }


def trainer_cell(
    config: Path, cell_id: str, index: int, log_path: Path, single_threaded: bool = True
) -> ServiceProcess:
    """A trainer cell process on ``config``, not started yet; ``single_threaded``: one
    OpenMP thread (the cells of a test share the machine's cores)."""
    return ServiceProcess(
        "cell_agent.training.worker",
        config,
        {"cell_id": cell_id, "index": index},
        env={"OMP_NUM_THREADS": "1"} if single_threaded else None,
        log_path=log_path,
    )


def trainer_cells(
    config: Path,
    count: int,
    log_dir: Path,
    prefix: str = "c",
    log_prefix: str = "",
    single_threaded: bool = True,
) -> list[ServiceProcess]:
    """``count`` trainer cells (:func:`trainer_cell`): ``<prefix><i>`` at index ``i`` (0 is the
    core), each logging to ``<log_dir>/<log_prefix><prefix><i>.log``."""
    return [
        trainer_cell(config, f"{prefix}{i}", i, log_dir / f"{log_prefix}{prefix}{i}.log", single_threaded)
        for i in range(count)
    ]


async def start_cells(cells: list[ServiceProcess], timeout_s: float) -> list[str]:
    """Starts ``cells`` one after the other (off the event loop, each given ``timeout_s`` to
    be ready): their targets."""
    for cell in cells:
        await asyncio.to_thread(cell.start, timeout_s)
    return [cell.target for cell in cells]


async def join_batch(
    channel: grpc.aio.Channel,
    epoch: int,
    batch_id: int,
    policy_version: int,
    prefix_size: int,
    core_target: str,
    timeout_s: float = 60.0,
) -> bool:
    """JoinBatch fenced with the leader's ``epoch``; whether the cell joined. Retried, as
    the scheduler retries it, while the trainer answers that it is still starting (a
    process is ready before every elastic cell has joined its groups), for up to
    ``timeout_s``; any other error is raised."""
    request = pb.JoinBatchRequest(
        fence=cpb.Fence(epoch=epoch),
        batch_id=batch_id,
        policy_version=policy_version,
        prefix_size=prefix_size,
        core_target=core_target,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            reply = await pb_grpc.CellControlStub(channel).JoinBatch(request, timeout=timeout_s)
            return bool(reply.joined)
        except grpc.aio.AioRpcError as err:
            starting = err.code() == grpc.StatusCode.UNAVAILABLE and STARTING in (err.details() or "")
            if not starting or loop.time() >= deadline:
                raise
        await asyncio.sleep(0.5)
