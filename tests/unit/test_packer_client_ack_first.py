"""StreamingPackerSource.ack_and_claim_many against a packer that predates ClaimStream's
``ack_first`` (it ignores the field and answers the claim alone, without ``acked``): the
client sends the ack by itself, so the ack is never lost; against one that knows the field,
one request carries both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from gyre.v1 import packer_pb2 as pb
from gyre.v1 import packer_pb2_grpc as pb_grpc
from services.cell_agent.training.microstep import Outcome
from services.cell_agent.training.packer_client import StreamingPackerSource


class FakePacker(pb_grpc.PackerServicer):
    """ClaimStream only: claims answer WAIT; ``knows_ack_first`` decides whether an ack
    carried with a claim is done (and answered in ``acked``) or ignored, as an old packer does."""

    def __init__(self, knows_ack_first: bool) -> None:
        self.knows = knows_ack_first
        self.requests: list[pb.ClaimStreamRequest] = []
        self.acked: list[list[str]] = []

    async def ClaimStream(self, requests: AsyncIterator[pb.ClaimStreamRequest], context: Any) -> Any:
        async for r in requests:
            self.requests.append(r)
            if r.WhichOneof("request") == "ack":
                self.acked.append(list(r.ack.micro_step_ids))
                yield pb.ClaimStreamResponse(tag=r.tag, ack=pb.AckMicroStepsResponse(duplicate=[False]))
                continue
            out = pb.ClaimStreamResponse(
                tag=r.tag, claim=pb.ClaimMicroStepsResponse(outcome=pb.CLAIM_OUTCOME_WAIT)
            )
            if self.knows and r.HasField("ack_first"):
                self.acked.append(list(r.ack_first.micro_step_ids))
                out.acked.duplicate.extend([True] * len(r.ack_first.micro_step_ids))
            yield out


async def _run(knows: bool) -> tuple[FakePacker, list[bool], Outcome]:
    server = grpc.aio.server()
    fake = FakePacker(knows)
    pb_grpc.add_PackerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    source = StreamingPackerSource("", "cell0", channel=ch)
    try:
        dups, claims = await source.ack_and_claim_many(1, ["b1-m0"], 0, 0.0, 4, "k")
        return fake, dups, claims[0].outcome
    finally:
        await source.close()
        await ch.close()
        await server.stop(None)


async def test_one_request_carries_both_when_the_packer_knows_ack_first() -> None:
    fake, dups, outcome = await _run(knows=True)
    assert dups == [True] and outcome is Outcome.WAIT
    assert len(fake.requests) == 1 and fake.acked == [["b1-m0"]]
    assert fake.requests[0].ack_first.cell_id == "cell0" and fake.requests[0].claim.claim_id == "k"


async def test_an_older_packer_gets_the_ack_by_itself() -> None:
    fake, dups, outcome = await _run(knows=False)
    assert dups == [False] and outcome is Outcome.WAIT
    assert [r.WhichOneof("request") for r in fake.requests] == ["claim", "ack"] and fake.acked == [["b1-m0"]]
