"""What an operator reads from each service over gRPC, one call each on a channel the test
dialled: the scheduler's status, the packer's current batch, the router's and a cell's
status."""

from __future__ import annotations

import grpc

from gyre.v1.cell_agent_pb2 import CellStatus, GetCellStatusRequest
from gyre.v1.cell_agent_pb2_grpc import CellControlStub
from gyre.v1.packer_pb2 import BatchStatus, GetBatchRequest
from gyre.v1.packer_pb2_grpc import PackerStub
from gyre.v1.router_pb2 import GetRouterStatusRequest, RouterStatus
from gyre.v1.router_pb2_grpc import RouterStub
from gyre.v1.scheduler_pb2 import GetStatusRequest, SchedulerStatus
from gyre.v1.scheduler_pb2_grpc import SchedulerControlStub


async def scheduler_status(ch: grpc.aio.Channel) -> SchedulerStatus:
    """The scheduler's ``GetStatus``."""
    return await SchedulerControlStub(ch).GetStatus(GetStatusRequest(), timeout=5)


async def packer_batch(ch: grpc.aio.Channel) -> BatchStatus:
    """The packer's ``GetBatch`` of its current batch."""
    return await PackerStub(ch).GetBatch(GetBatchRequest(), timeout=5)


async def router_status(ch: grpc.aio.Channel) -> RouterStatus:
    """The router's ``GetRouterStatus``."""
    return await RouterStub(ch).GetRouterStatus(GetRouterStatusRequest(), timeout=5)


async def cell_status(ch: grpc.aio.Channel) -> CellStatus:
    """A cell agent's ``GetCellStatus``."""
    return await CellControlStub(ch).GetCellStatus(GetCellStatusRequest(), timeout=5)
