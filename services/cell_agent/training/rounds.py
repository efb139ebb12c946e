"""One batch on this cell once it has joined (:class:`BatchRounds`), the core's path and a
satellite's:

* the core trains on its version ``v`` (the claim loop), freezes the membership, reduces
  gradient sums and [tokens, stale, diagnostics] over the prefix group, steps once
  (idempotent per batch id, durable before it is announced), commits the batch at the
  packer, broadcasts the version and weights, exposes snapshot ``v+1`` and publishes it;
* a satellite holds ``v`` (pulling it from the core unless it has it; if it cannot, it
  contributes nothing but its stale mark), trains on it, learns the prefix size, reduces,
  then receives the new version and weights.

A failed collective breaks the prefix groups (the controller refuses joins until they are
re-formed); a failed batch leaves no gradient behind. After each batch the freed heap goes
back to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from gyre import heap
from gyre.errors import FailedPrecondition, GyreError, Unavailable
from gyre.history import History
from services.cell_agent.snapshots import SnapshotStore
from services.cell_agent.training.claim_loop import ClaimLoop
from services.cell_agent.training.core import CoreOptimizer, failpoint
from services.cell_agent.training.outcomes import BatchBook, BatchOutcome
from services.cell_agent.training.params import ControllerParams
from services.cell_agent.training.ports import Collective, Membership, PolicyPublisher, Puller
from services.cell_agent.training.trainer import LossStats, Trainer

log = logging.getLogger(__name__)


class BatchRounds:
    """Runs one joined batch to its end on the core or on a satellite."""

    def __init__(
        self,
        *,
        index: int,
        trainer: Trainer,
        snapshots: SnapshotStore,
        membership: Membership,
        collective: Collective,
        publisher: PolicyPublisher | None,
        puller: Puller,
        core: CoreOptimizer | None,
        claims: ClaimLoop,
        book: BatchBook,
        params: ControllerParams,
        clock: Callable[[], float],
        history: History,
        on_step: Callable[[BatchOutcome], None] | None,
        on_broken: Callable[[str], None],
    ) -> None:
        self.index = index
        self.trainer = trainer
        self.snapshots = snapshots
        self.membership = membership
        self.collective = collective
        self.publisher = publisher
        self.puller = puller
        self.core = core
        self.claims = claims
        self.book = book
        self.params = params
        self.clock = clock
        self.history = history
        self.on_step = on_step
        self.on_broken = on_broken
        """Called with why when a collective fails (the prefix groups are broken)."""

    async def run_core(self, batch_id: int, version: int, started: float) -> BatchOutcome:
        try:
            out = await self._core_batch(batch_id, version, started)
        except BaseException:
            self.trainer.close_window()  # a failed batch leaves no gradient behind
            raise
        await self._release_heap()
        return out

    async def run_satellite(
        self, batch_id: int, version: int, core_target: str, started: float
    ) -> BatchOutcome:
        try:
            out = await self._satellite_batch(batch_id, version, core_target, started)
        except BaseException:
            self.trainer.close_window()
            raise
        await self._release_heap()
        return out

    async def _release_heap(self) -> None:
        """Hands the memory the batch freed back to the system (see :mod:`gyre.heap`):
        without it the allocator kept it resident, and the core's RSS crept up for hours."""
        if self.params.release_heap:
            await asyncio.to_thread(heap.release_free_heap)

    async def _collective(
        self, op: Callable[[int, torch.Tensor], None], k: int, tensor: torch.Tensor
    ) -> None:
        """One collective; a failure (a peer died, a timeout) breaks the prefix groups."""
        try:
            await asyncio.to_thread(op, k, tensor)
        except Exception as exc:
            broken = f"{type(exc).__name__}: {exc}"
            self.on_broken(broken)
            log.error(
                "collective failed: the prefix groups are broken until they are re-formed",
                extra={"prefix": k, "error": broken},
            )
            raise Unavailable(f"collective over the prefix of {k} failed: {exc}") from exc

    async def _core_batch(self, batch_id: int, version: int, started: float) -> BatchOutcome:
        assert self.core is not None
        out = BatchOutcome(batch_id, version)
        self.trainer.open_window(version)
        await self.claims.consume(batch_id, version, out, started)
        failpoint("training.before_reduce")  # every micro-step acked, nothing durable yet
        # 3. Close the joining window.
        k = await asyncio.to_thread(self.membership.freeze, batch_id)
        out.prefix_size = k
        # 4. Reduce to the core, step once.
        grad = self.trainer.flat_grads()
        header, peak = self._header(stale=False, device=grad.device)
        if k > 1:
            await self._collective(self.collective.reduce_to_core, k, grad)
            await self._collective(self.collective.reduce_to_core, k, header)
            await self._collective(functools.partial(self.collective.reduce_to_core, op="max"), k, peak)
        out.total_tokens, out.stale_participants = int(header[0].item()), int(header[1].item())
        stats = LossStats.from_tensors(header[2:], float(peak[0].item()))
        result = await asyncio.to_thread(self.core.step, batch_id, grad, out.total_tokens)
        self.trainer.close_window()
        out.new_version, out.applied = result.version, result.applied
        out.diagnostics = {**stats.summary(), "grad_norm": result.grad_norm}
        self.history.append(
            "step",
            0,
            b=batch_id,
            v=version,
            new_v=result.version,
            applied=result.applied,
            diag=out.diagnostics,
        )
        if self.on_step is not None and result.applied:
            await asyncio.to_thread(self.on_step, out)
        failpoint("training.before_commit")
        await self.claims.commit(batch_id)  # the step is durable: the micro-steps are trained for good
        # 5. Share: broadcast to the prefix, expose, publish.
        if k > 1:
            # The step is committed: a satellite lost now does not stop its publication.
            with contextlib.suppress(Unavailable):
                await self._collective(
                    self.collective.broadcast_from_core,
                    k,
                    torch.tensor([float(result.version)], dtype=torch.float64, device=grad.device),
                )
                await self._collective(
                    self.collective.broadcast_from_core, k, self.trainer.flat_params().contiguous()
                )
        await asyncio.to_thread(self.snapshots.publish, result.version, self.trainer.state_dict())
        if self.publisher is not None and result.applied:
            await self.publisher.publish(result.version, batch_id, out.diagnostics)
            self.history.append("publish", 0, b=batch_id, v=result.version)
        out.seconds = self.clock() - started
        self.book.record(out)
        log.info("batch stepped", extra=dataclasses.asdict(out))
        return out

    async def _satellite_batch(
        self, batch_id: int, version: int, core_target: str, started: float
    ) -> BatchOutcome:
        out = BatchOutcome(batch_id, version)
        # 1. Hold version v: pull it from the core unless this cell has it already.
        if self.trainer.version != version:
            try:
                got, state = await self.puller(core_target, version)
                if got != version:
                    raise FailedPrecondition(f"pulled version {got}, wanted {version}")
                await asyncio.to_thread(self.trainer.load_state, state, version)
            except (GyreError, OSError) as exc:
                log.warning(
                    "cannot hold the batch's version; contributing nothing", extra={"error": repr(exc)}
                )
                out.stale = True
        out.joined_s = self.clock() - started
        if not out.stale:
            self.trainer.open_window(version)
            await self.claims.consume(batch_id, version, out, started)
        # 3. The core closes the window; learn the prefix size.
        k = await asyncio.to_thread(self.membership.wait_frozen, batch_id, self.params.collective_timeout_s)
        out.prefix_size = k
        if self.index >= k:  # cannot happen: registration precedes the freeze
            raise FailedPrecondition(f"index {self.index} outside the frozen prefix {k}")
        # 4. Reduce (zeros when stale: a gradient on another version never enters).
        grad = self.trainer.flat_grads()
        if out.stale:
            grad.zero_()
        header, peak = self._header(stale=out.stale, device=grad.device)
        await self._collective(self.collective.reduce_to_core, k, grad)
        await self._collective(self.collective.reduce_to_core, k, header)
        await self._collective(functools.partial(self.collective.reduce_to_core, op="max"), k, peak)
        self.trainer.close_window()
        # 5. Receive the new weights.
        ver = torch.zeros(1, dtype=torch.float64, device=grad.device)
        await self._collective(self.collective.broadcast_from_core, k, ver)
        flat = torch.empty_like(self.trainer.flat_params())
        await self._collective(self.collective.broadcast_from_core, k, flat)
        out.new_version = int(ver.item())
        await asyncio.to_thread(self.trainer.load_flat_params, flat, out.new_version)
        await asyncio.to_thread(self.snapshots.publish, out.new_version, self.trainer.state_dict())
        out.seconds = self.clock() - started
        self.book.record(out)
        log.info("batch done", extra=dataclasses.asdict(out))
        return out

    def _header(self, stale: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """What this cell reduces to the core beside its gradient: [tokens, stale, the
        diagnostics' sums] (SUM) and [the largest behaviour weight] (MAX). A stale satellite
        contributes nothing but its stale mark."""
        stats = LossStats() if stale else self.trainer.stats
        head = torch.tensor(
            [0.0 if stale else float(self.trainer.tokens), 1.0 if stale else 0.0], dtype=torch.float64
        )
        header = torch.cat([head, stats.sums_tensor()]).to(device)
        return header, torch.tensor([stats.weight_max], dtype=torch.float64, device=device)
