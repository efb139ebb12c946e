"""What the training benchmarks and tests send as the scheduler would: ``JoinBatch`` to a
trainer (over a channel opened with the scheduler's identity)."""

from __future__ import annotations

import asyncio

import grpc

from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2 as cpb

STARTING = "still starting"
"""What a trainer's UNAVAILABLE says while its prefix groups are not formed yet."""


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
