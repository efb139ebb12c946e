"""In-process fakes of the training controller's ports (a packer source, membership,
collectives, publisher) for unit tests; the fake packer itself lives in
``testkit.fake_packer``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import torch

from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.controller import ControllerParams, TrainingController
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.microstep import Claim
from services.cell_agent.training.ports import JoinResult
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import FakePacker

TOL = 1e-10
"""Equivalence tolerance of float64 training runs that must agree (elastic vs one cell,
segments vs turns)."""


class FakeSource:
    """One cell's :class:`MicroStepSource` over a :class:`FakePacker`."""

    def __init__(self, packer: FakePacker, cell_id: str) -> None:
        self.packer = packer
        self.cell_id = cell_id

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        return await asyncio.to_thread(
            self.packer.claim_many_sync, self.cell_id, batch_id, policy_version, wait_s, max_micro_steps
        )

    async def ack_many(self, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        for m in micro_step_ids:
            self.packer.ack_sync(batch_id, m)
        return [False] * len(micro_step_ids)

    async def open_batch(self, batch_id: int) -> None:
        self.packer.open_sync(batch_id)

    async def commit(self, batch_id: int) -> None:
        self.packer.commit_sync(batch_id)

    async def keep(self) -> None:
        return None


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

    def members(self, batch_id: int) -> int:
        with self._cond:
            return self._state[batch_id][1] if batch_id in self._state else 0

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

    def _run(
        self, kind: str, k: int, rank: int, tensor: torch.Tensor, timeout_s: float = 60.0, op: str = "sum"
    ) -> None:
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
                    total = torch.maximum(total, parts[r]) if op == "max" else total + parts[r]
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

    def reduce_to_core(self, k: int, tensor: torch.Tensor, op: str = "sum") -> None:
        self.parent._run("reduce", k, self.rank, tensor, op=op)

    def broadcast_from_core(self, k: int, tensor: torch.Tensor) -> None:
        self.parent._run("broadcast", k, self.rank, tensor)


class RecordingPublisher:
    """A :class:`PolicyPublisher` that remembers what it published."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []
        self.diagnostics: dict[int, dict[str, Any]] = {}  # by version

    async def publish(self, version: int, batch_id: int, diagnostics: dict[str, Any] | None = None) -> None:
        self.published.append((version, batch_id))
        self.diagnostics[version] = dict(diagnostics or {})


def tiny_lm(seed: int = 0, dtype: torch.dtype = torch.float64, vocab: int = 512, hidden: int = 64):
    """A small in-memory Qwen2 causal LM (no directory), dropout off."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    # Random init is N(0, 0.02): scale up so the loss has a real gradient everywhere.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model


def core_controller(packer: FakePacker, membership: InProcessMembership | None = None) -> TrainingController:
    """A core's :class:`TrainingController` (index 0, the tiny model at version 1) over
    ``packer``, alone in its prefix, with short claim waits: for tests of how a batch is
    joined, abandoned or left."""

    async def no_pull(target: str, version: int) -> Any:
        raise AssertionError("the core never pulls")

    trainer = Trainer(tiny_lm(seed=0), version=1)
    return TrainingController(
        cell_id="c0",
        index=0,
        trainer=trainer,
        snapshots=SnapshotStore(keep=2),
        source=FakeSource(packer, "c0"),
        membership=membership or InProcessMembership(),
        collective=InProcessCollective().for_rank(0),
        publisher=RecordingPublisher(),
        puller=no_pull,
        core=CoreOptimizer(trainer, OptimConfig(lr=1e-2)),
        params=ControllerParams(claim_wait_s=0.05, join_wait_s=5.0, collective_timeout_s=60),
    )
