"""A training-only elastic cell as a process, for multi-process tests and the benchmark:
``python -m services.cell_agent.training.worker --config F --set cell_id=c1 --set index=1``.

It serves the training part of the cell agent's API on one port: ``CellControl.JoinBatch``
(fenced) and ``WeightSnapshots.PullSnapshot``; the other CellControl methods answer
UNIMPLEMENTED (the real cell agent serves them).
"""

from __future__ import annotations

import grpc
from pydantic import Field

from gyre import runtime
from gyre.config import ServiceConfig
from gyre.etcd.election import verified_fence
from gyre.fencing import FenceGuard
from gyre.grpcx.errors import rpc
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from services.cell_agent import snapshots
from services.cell_agent.servicer import CellControlServicer
from services.cell_agent.training.config import TrainingSettings
from services.cell_agent.training.service import TrainingService


class TrainerCellConfig(ServiceConfig):
    """A training-only cell."""

    SECTION = "trainer_cell"
    cell_id: str = Field("cell-0", description="This cell's id.")
    index: int = Field(0, ge=0, description="Elastic index: 0 is the core.")
    training: TrainingSettings = Field(default_factory=TrainingSettings, description="Trainer settings.")


class TrainingControlServicer(pb_grpc.CellControlServicer):
    """JoinBatch only."""

    ACCESS = CellControlServicer.ACCESS  # the same service, so the same callers

    def __init__(self, training: TrainingService, fence: FenceGuard | None = None) -> None:
        self.training = training
        self.fence = fence or FenceGuard()

    @rpc
    async def JoinBatch(
        self, request: pb.JoinBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinBatchResponse:  # noqa: N802
        await self.fence.admit(request.fence.epoch)
        joined = await self.training.join_batch(
            request.batch_id, request.policy_version, request.prefix_size, request.core_target
        )
        return pb.JoinBatchResponse(joined=joined)


def _main() -> None:
    holder: dict[str, TrainingService] = {}

    async def build(rt: runtime.Runtime):
        cfg: TrainerCellConfig = rt.config  # type: ignore[assignment]
        # The port is not known before the server starts: the target is filled in after.
        training = TrainingService(
            cfg.training, cell_id=cfg.cell_id, index=cfg.index, target="", etcd=rt.etcd, keys=rt.keys
        )
        holder["t"] = training
        fence, leader = verified_fence(rt.etcd, rt.keys.leader())
        rt.supervisor.spawn("leader", leader.run())
        return [
            (
                TrainingControlServicer(training, fence),
                pb_grpc.add_CellControlServicer_to_server,
                "gyre.v1.CellControl",
            ),
            snapshots.registration(training.snapshots),
        ]

    async def after_start(rt: runtime.Runtime) -> None:
        training = holder["t"]
        training.target = rt.target
        rt.supervisor.spawn("training", training.run())

    runtime.main("trainer_cell", TrainerCellConfig, build, after_start=after_start, instance_field="cell_id")


if __name__ == "__main__":
    _main()
