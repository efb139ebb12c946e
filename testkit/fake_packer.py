"""The one fake packer: the Packer service's gRPC surface in memory, for the tests and
benchmarks of the packer's callers (:class:`FakePacker`), and the random micro-steps it is
fed with (:func:`synthetic_batch`).

Each caller finds the part it talks to:

- the router: ``RecordTurn`` is recorded in :attr:`FakePacker.turns` (idempotent on
  ``(execution_id, turn_index)``, as the packer is);
- the scheduler: ``ReportFinish`` is recorded in :attr:`FakePacker.reports` (idempotent),
  ``SealBatch`` in :attr:`FakePacker.sealed`, and ``WatchSupply`` streams the supply the
  test sets (:meth:`FakePacker.set_supply`);
- trainers: the claim side (``OpenBatch``, ``ClaimMicroSteps``, ``AckMicroSteps``,
  ``KeepClaims``, ``CommitBatch``) over batches the test adds. It can hold micro-steps back
  (a data pause) and release them on demand, or for one cell, so satellites join at chosen
  micro-steps.
  Its ``*_sync`` methods are the same claim side without gRPC, for in-process tests.

It lives in ``testkit`` because benchmarks drive trainers with it and benchmarks may
not import test code (tests may import bench rigs). :meth:`FakePacker.start` serves it on a
loopback port with the packer's certificate (callers check it), as the real one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import AsyncIterator

import grpc

from gyre.errors import FailedPrecondition, InvalidArgument
from gyre.grpcx.errors import rpc, rpc_stream
from gyre.grpcx.tls import TlsFiles
from gyre.v1 import packer_pb2 as ppb
from gyre.v1 import packer_pb2_grpc as ppb_grpc
from services.cell_agent.training.microstep import Claim, MicroStep, Outcome, Sequence
from testkit.loopback import serve_loopback


def synthetic_batch(
    batch_id: int,
    micro_steps: int,
    *,
    seqs_per_step: int = 2,
    vocab: int = 512,
    min_len: int = 6,
    max_len: int = 24,
    seed: int = 0,
) -> list[MicroStep]:
    """Random micro-steps: prompt tokens unmasked, output tokens masked in, behaviour
    log-probs spread so that some ratios clip, advantages of both signs."""
    rng = random.Random(seed * 1000 + batch_id)
    out = []
    for m in range(micro_steps):
        seqs = []
        for s in range(seqs_per_step):
            n = rng.randint(min_len, max_len)
            prompt = rng.randint(1, n - 1)
            ids = tuple(rng.randrange(vocab) for _ in range(n))
            mask = tuple(0 if i < prompt else (0 if rng.random() < 0.1 else 1) for i in range(n))
            lps = tuple(-rng.uniform(4.5, 8.0) if mk else 0.0 for mk in mask)
            seqs.append(Sequence(ids, mask, lps, rng.uniform(-1.5, 1.5), f"e{batch_id}-{m}-{s}"))
        out.append(MicroStep(f"b{batch_id}-m{m:04d}", batch_id, tuple(seqs)))
    return out


@dataclasses.dataclass
class _Batch:
    version: int
    steps: list[MicroStep]
    released: int
    next: int = 0
    acked: set[str] = dataclasses.field(default_factory=set)
    reserved: dict[int, str] = dataclasses.field(default_factory=dict)  # position -> cell
    claimed_by: dict[str, str] = dataclasses.field(default_factory=dict)
    attempts: int = 0  # OpenBatch calls (a reopen hands every micro-step out again)
    committed: bool = False


class FakePacker(ppb_grpc.PackerServicer):
    """The packer's RPCs in memory (see the module's docstring); other RPCs: UNIMPLEMENTED.
    Claim-side state is thread-safe (trainers' threads claim through the ``*_sync``
    methods); claims long-poll up to the request's ``wait_s``."""

    def __init__(self) -> None:
        self._batches: dict[int, _Batch] = {}
        self._cond = threading.Condition()
        self.turns: dict[tuple[str, int], ppb.TurnRecord] = {}
        self.reports: dict[str, ppb.FinishReport] = {}
        self.sealed: list[tuple[int, int]] = []
        self.supply = ppb.SupplySignal(ready_groups=0, batch_needs=0, batch_id=1)
        self._supply_changed = asyncio.Event()
        self.target = ""
        self._server: grpc.aio.Server | None = None

    async def start(self, tls: TlsFiles) -> FakePacker:
        """Serves on a free loopback port as ``tls``'s identity (the packer's: its callers
        check it); :attr:`target` is where."""
        self._server, self.target = await serve_loopback([(self, ppb_grpc.add_PackerServicer_to_server)], tls)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    # -- the router's side ---------------------------------------------------------------

    @rpc
    async def RecordTurn(
        self, request: ppb.TurnRecord, context: grpc.aio.ServicerContext
    ) -> ppb.RecordTurnResponse:  # noqa: N802
        key = (request.execution_id, request.turn_index)
        dup = key in self.turns
        self.turns.setdefault(key, request)
        return ppb.RecordTurnResponse(duplicate=dup)

    # -- the scheduler's side ------------------------------------------------------------

    def set_supply(self, ready: int, needs: int, batch_id: int = 1) -> None:
        """The supply signal :meth:`WatchSupply` streams from now on."""
        self.supply = ppb.SupplySignal(ready_groups=ready, batch_needs=needs, batch_id=batch_id)
        self._supply_changed.set()

    @rpc
    async def ReportFinish(
        self, request: ppb.FinishReport, context: grpc.aio.ServicerContext
    ) -> ppb.ReportFinishResponse:  # noqa: N802
        dup = request.execution_id in self.reports
        self.reports.setdefault(request.execution_id, request)
        return ppb.ReportFinishResponse(duplicate=dup)

    @rpc
    async def GetBatch(
        self, request: ppb.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> ppb.BatchStatus:  # noqa: N802
        return self.batch_status(request.batch_id or self.supply.batch_id)

    @rpc
    async def SealBatch(
        self, request: ppb.SealBatchRequest, context: grpc.aio.ServicerContext
    ) -> ppb.BatchStatus:  # noqa: N802
        self.sealed.append((request.fence.epoch, request.batch_id))
        return ppb.BatchStatus(batch_id=request.batch_id, sealed=True)

    @rpc_stream
    async def WatchSupply(
        self, request: ppb.WatchSupplyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ppb.SupplySignal]:  # noqa: N802
        while True:
            yield self.supply
            self._supply_changed.clear()
            await self._supply_changed.wait()

    # -- the trainers' side: claims ------------------------------------------------------

    def add_batch(
        self, batch_id: int, version: int, steps: list[MicroStep], released: int | None = None
    ) -> None:
        with self._cond:
            self._batches[batch_id] = _Batch(
                version, list(steps), len(steps) if released is None else released
            )
            self._cond.notify_all()

    def release(self, batch_id: int, n: int | None = None, for_cell: str | None = None) -> None:
        """Makes ``n`` more micro-steps claimable (all when None); ``for_cell`` reserves
        them for one cell (a scripted schedule: others see WAIT until it claims them)."""
        with self._cond:
            b = self._batches[batch_id]
            new = len(b.steps) if n is None else min(len(b.steps), b.released + n)
            if for_cell is not None:
                for pos in range(b.released, new):
                    b.reserved[pos] = for_cell
            b.released = new
            self._cond.notify_all()

    def claimed(self, batch_id: int) -> int:
        with self._cond:
            return self._batches[batch_id].next

    def claimed_by(self, batch_id: int) -> dict[str, str]:
        with self._cond:
            return dict(self._batches[batch_id].claimed_by)

    def wait_claimed(self, batch_id: int, n: int, timeout_s: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._batches[batch_id].next >= n, timeout_s):
                raise TimeoutError(f"batch {batch_id}: {n} claims not reached")

    def claim_sync(self, cell_id: str, batch_id: int, version: int, wait_s: float) -> Claim:
        with self._cond:
            b = self._batches.get(batch_id)
            if b is None:
                raise FailedPrecondition(f"unknown batch {batch_id}")
            if version != b.version:
                raise FailedPrecondition(f"batch {batch_id} trains on version {b.version}, not {version}")

            def mine() -> bool:
                return b.reserved.get(b.next, cell_id) == cell_id

            def ready() -> bool:
                return (b.next < b.released and mine()) or b.next >= len(b.steps)

            self._cond.wait_for(ready, wait_s)
            if b.next >= len(b.steps):
                return Claim(Outcome.CLOSED)
            if b.next >= b.released or not mine():
                return Claim(Outcome.WAIT)
            step = b.steps[b.next]
            b.next += 1
            b.claimed_by[step.micro_step_id] = cell_id
            self._cond.notify_all()
            return Claim(Outcome.CLAIMED, step, ttl_s=30.0)

    def claim_many_sync(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, n: int
    ) -> list[Claim]:
        """Up to ``n`` claims, waiting only for the first (the packer's ClaimMicroSteps): one
        CLAIMED claim per micro-step, or a single WAIT / CLOSED claim."""
        first = self.claim_sync(cell_id, batch_id, version, wait_s)
        claims = [first]
        while first.outcome is Outcome.CLAIMED and len(claims) < n:
            more = self.claim_sync(cell_id, batch_id, version, 0.0)
            if more.outcome is not Outcome.CLAIMED:
                break
            claims.append(more)
        return claims

    def ack_sync(self, batch_id: int, micro_step_id: str) -> None:
        with self._cond:
            self._batches[batch_id].acked.add(micro_step_id)

    def open_sync(self, batch_id: int) -> None:
        """The core opens an attempt: an earlier attempt's claims and acks are void, every
        micro-step is handed out again (the packer's OpenBatch)."""
        with self._cond:
            b = self._batches.get(batch_id)
            if b is None:
                raise FailedPrecondition(f"unknown batch {batch_id}")
            if b.committed:
                raise FailedPrecondition(f"batch {batch_id} is committed")
            b.attempts += 1
            b.next, b.acked, b.claimed_by = 0, set(), {}
            self._cond.notify_all()

    def commit_sync(self, batch_id: int) -> None:
        with self._cond:
            b = self._batches[batch_id]
            if not b.committed and len(b.acked) != len(b.steps):
                raise FailedPrecondition(f"batch {batch_id}: {len(b.acked)} of {len(b.steps)} acknowledged")
            b.committed = True

    def batch_status(self, batch_id: int) -> ppb.BatchStatus:
        """What ``GetBatch`` answers: a batch added here with its claim counts (``done``
        once every micro-step is acknowledged), any other with its id alone."""
        with self._cond:
            b = self._batches.get(batch_id)
            if b is None:
                return ppb.BatchStatus(batch_id=batch_id)
            n = len(b.steps)
            return ppb.BatchStatus(
                batch_id=batch_id,
                policy_version=b.version,
                micro_steps=n,
                claimed=b.next - len(b.acked),
                acked=len(b.acked),
                sealed=True,
                closed=b.next >= n,
                done=len(b.acked) == n,
                unclaimed=max(0, b.released - b.next),
                participants=sorted(set(b.claimed_by.values())),
                committed=b.committed,
            )

    def status(self, batch_id: int) -> tuple[int, int, bool]:
        """(attempts, acked, committed) of a batch."""
        with self._cond:
            b = self._batches[batch_id]
            return b.attempts, len(b.acked), b.committed

    @rpc
    async def ClaimMicroSteps(
        self, request: ppb.ClaimMicroStepsRequest, context: grpc.aio.ServicerContext
    ) -> ppb.ClaimMicroStepsResponse:  # noqa: N802
        if not 0 <= request.wait_s <= 30:
            raise InvalidArgument("wait_s out of range")
        if not 1 <= request.max_micro_steps <= 64:
            raise InvalidArgument("max_micro_steps out of range")
        claims = await asyncio.to_thread(
            self.claim_many_sync,
            request.cell_id,
            request.batch_id,
            request.policy_version,
            request.wait_s,
            request.max_micro_steps,
        )
        return ppb.ClaimMicroStepsResponse(
            outcome=claims[0].outcome.to_proto(),
            micro_steps=[c.micro_step.to_proto() for c in claims if c.micro_step],
            claim_ttl_s=claims[0].ttl_s,
        )

    @rpc
    async def AckMicroSteps(
        self, request: ppb.AckMicroStepsRequest, context: grpc.aio.ServicerContext
    ) -> ppb.AckMicroStepsResponse:  # noqa: N802
        for m in request.micro_step_ids:
            self.ack_sync(request.batch_id, m)
        return ppb.AckMicroStepsResponse(duplicate=[False] * len(request.micro_step_ids))

    @rpc
    async def OpenBatch(
        self, request: ppb.OpenBatchRequest, context: grpc.aio.ServicerContext
    ) -> ppb.BatchStatus:  # noqa: N802
        await asyncio.to_thread(self.open_sync, request.batch_id)
        return ppb.BatchStatus(batch_id=request.batch_id)

    @rpc
    async def CommitBatch(
        self, request: ppb.CommitBatchRequest, context: grpc.aio.ServicerContext
    ) -> ppb.BatchStatus:  # noqa: N802
        await asyncio.to_thread(self.commit_sync, request.batch_id)
        return ppb.BatchStatus(batch_id=request.batch_id, committed=True)

    @rpc
    async def KeepClaims(
        self, request: ppb.KeepClaimsRequest, context: grpc.aio.ServicerContext
    ) -> ppb.KeepClaimsResponse:  # noqa: N802
        return ppb.KeepClaimsResponse()
