"""What the training benchmarks and tests send as the scheduler would: ``JoinBatch`` to a
trainer (over a channel opened with the scheduler's identity)."""

from __future__ import annotations

import grpc

from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2 as cpb


async def join_batch(
    channel: grpc.aio.Channel,
    epoch: int,
    batch_id: int,
    policy_version: int,
    prefix_size: int,
    core_target: str,
    timeout_s: float = 60.0,
) -> bool:
    """JoinBatch fenced with the leader's ``epoch``; whether the cell joined."""
    reply = await pb_grpc.CellControlStub(channel).JoinBatch(
        pb.JoinBatchRequest(
            fence=cpb.Fence(epoch=epoch),
            batch_id=batch_id,
            policy_version=policy_version,
            prefix_size=prefix_size,
            core_target=core_target,
        ),
        timeout=timeout_s,
    )
    return bool(reply.joined)
