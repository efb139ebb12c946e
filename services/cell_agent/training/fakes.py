"""In-process fakes of the training controller's ports (packer, membership, collectives,
publisher) and a synthetic batch generator, for unit tests, the multi-process tests' fake
packer and the benchmark. The fake packer can hold micro-steps back (a data pause) and
release them on demand, so satellites can be made to join at chosen micro-steps."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import grpc
import torch

from gyre.errors import FailedPrecondition, InvalidArgument
from gyre.grpcx.errors import rpc
from gyre.v1 import packer_pb2 as ppb
from gyre.v1 import packer_pb2_grpc as ppb_grpc
from services.cell_agent.training.microstep import Claim, MicroStep, Outcome, Sequence
from services.cell_agent.training.ports import JoinResult


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


class FakePacker:
    """A packer's claim side in memory. ``released`` micro-steps are claimable; the rest
    wait for :meth:`release` (a data pause). Thread-safe; claims long-poll up to wait_s."""

    def __init__(self) -> None:
        self._batches: dict[int, _Batch] = {}
        self._cond = threading.Condition()

    def add_batch(self, batch_id: int, version: int, steps: list[MicroStep], released: int | None = None) -> None:
        with self._cond:
            self._batches[batch_id] = _Batch(version, list(steps), len(steps) if released is None else released)
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

    def ack_sync(self, batch_id: int, micro_step_id: str) -> None:
        with self._cond:
            self._batches[batch_id].acked.add(micro_step_id)


class FakeSource:
    """One cell's :class:`MicroStepSource` over a :class:`FakePacker`."""

    def __init__(self, packer: FakePacker, cell_id: str) -> None:
        self.packer = packer
        self.cell_id = cell_id

    async def claim(self, batch_id: int, policy_version: int, wait_s: float) -> Claim:
        return await asyncio.to_thread(self.packer.claim_sync, self.cell_id, batch_id, policy_version, wait_s)

    async def ack(self, batch_id: int, micro_step_id: str) -> None:
        self.packer.ack_sync(batch_id, micro_step_id)

    async def keep(self) -> None:
        return None


class FakePackerServicer(ppb_grpc.PackerServicer):
    """The claim RPCs of the Packer service over a :class:`FakePacker` (other RPCs:
    UNIMPLEMENTED), for multi-process tests and the benchmark."""

    def __init__(self, packer: FakePacker) -> None:
        self.packer = packer

    @rpc
    async def ClaimMicroStep(self, request: ppb.ClaimMicroStepRequest, context: grpc.aio.ServicerContext) -> ppb.ClaimMicroStepResponse:  # noqa: N802
        if not 0 <= request.wait_s <= 30:
            raise InvalidArgument("wait_s out of range")
        c = await asyncio.to_thread(
            self.packer.claim_sync, request.cell_id, request.batch_id, request.policy_version, request.wait_s
        )
        return ppb.ClaimMicroStepResponse(
            outcome=c.outcome.to_proto(),
            micro_step=c.micro_step.to_proto() if c.micro_step else None,
            claim_ttl_s=c.ttl_s,
        )

    @rpc
    async def AckMicroStep(self, request: ppb.AckMicroStepRequest, context: grpc.aio.ServicerContext) -> ppb.AckMicroStepResponse:  # noqa: N802
        self.packer.ack_sync(request.batch_id, request.micro_step_id)
        return ppb.AckMicroStepResponse()

    @rpc
    async def KeepClaims(self, request: ppb.KeepClaimsRequest, context: grpc.aio.ServicerContext) -> ppb.KeepClaimsResponse:  # noqa: N802
        return ppb.KeepClaimsResponse()


class InProcessMembership:
    """:class:`Membership` in memory (same semantics as the TCPStore one)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state: dict[int, tuple[int, int, bool]] = {}  # batch -> (version, joined, frozen)

    def open(self, batch_id: int, version: int) -> None:
        with self._cond:
            self._state.setdefault(batch_id, (version, 1, False))
            self._cond.notify_all()

    def register(self, batch_id: int, index: int) -> tuple[JoinResult, int]:
        with self._cond:
            if batch_id not in self._state:
                return JoinResult.NOT_YET, -1
            v, joined, frozen = self._state[batch_id]
            if frozen:
                return (JoinResult.JOINED if index < joined else JoinResult.CLOSED), v
            if index < joined:
                return JoinResult.JOINED, v
            if index > joined:
                return JoinResult.NOT_YET, v
            self._state[batch_id] = (v, joined + 1, False)
            return JoinResult.JOINED, v

    def freeze(self, batch_id: int) -> int:
        with self._cond:
            v, joined, _ = self._state[batch_id]
            self._state[batch_id] = (v, joined, True)
            self._cond.notify_all()
            return joined

    def wait_frozen(self, batch_id: int, timeout_s: float) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self._state.get(batch_id, (0, 0, False))[2], timeout_s):
                raise TimeoutError(f"batch {batch_id} not frozen")
            return self._state[batch_id][1]


class InProcessCollective:
    """Collectives among controllers of one process (threads). Each rank calls through its
    own :meth:`for_rank` view; contributions are summed in rank order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ops: dict[tuple[str, int, int], dict[int, torch.Tensor]] = {}
        self._seq: dict[tuple[str, int, int], int] = {}

    def for_rank(self, rank: int) -> _RankView:
        return _RankView(self, rank)

    def _run(self, kind: str, k: int, rank: int, tensor: torch.Tensor, timeout_s: float = 60.0) -> None:
        with self._cond:
            seq_key = (kind, k, rank)
            seq = self._seq.get(seq_key, 0)
            self._seq[seq_key] = seq + 1
            key = (kind, k, seq)
            parts = self._ops.setdefault(key, {})
            parts[rank] = tensor
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self._ops[key]) >= k, timeout_s):
                raise TimeoutError(f"{kind} over {k} ranks timed out")
            if kind == "reduce" and rank == 0:
                total = parts[0].clone()
                for r in range(1, k):
                    total += parts[r]
                tensor.copy_(total)
            elif kind == "broadcast" and rank != 0:
                tensor.copy_(parts[0])
            parts.setdefault(-1 - rank, tensor)  # mark done
            if sum(1 for r in parts if r < 0) >= k:
                del self._ops[key]
            self._cond.notify_all()
            # Rank 0's reduce result must be computed before other ranks' buffers change:
            # every rank waits until all are done with this op.
            self._cond.wait_for(lambda: key not in self._ops, timeout_s)


@dataclasses.dataclass
class _RankView:
    parent: InProcessCollective
    rank: int

    def reduce_to_core(self, k: int, tensor: torch.Tensor) -> None:
        self.parent._run("reduce", k, self.rank, tensor)

    def broadcast_from_core(self, k: int, tensor: torch.Tensor) -> None:
        self.parent._run("broadcast", k, self.rank, tensor)


class RecordingPublisher:
    """A :class:`PolicyPublisher` that remembers what it published."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []

    async def publish(self, version: int, batch_id: int) -> None:
        self.published.append((version, batch_id))


def tiny_lm(seed: int = 0, dtype: torch.dtype = torch.float64, vocab: int = 512, hidden: int = 64):
    """A small in-memory Qwen2 causal LM (no directory), dropout off."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    # Random init is N(0, 0.02): scale up so the loss has a real gradient everywhere.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model
