"""The core's optimizer authority: normalize the reduced gradient sum by the batch's
tokens, clip, take exactly one AdamW step per batch id, and make it durable.

The order of one step (each a failpoint, see :func:`failpoint`):
  1. write-ahead: the reduced gradient sum and token count (``pending-b<id>``);
  2. normalize, clip, ``optimizer.step()`` (in memory);
  3. checkpoint: weights + optimizer state + batch id (the step's record), drop the WAL.
A step for a batch at or below the last committed one is a no-op (duplicate command). A
restarted core loads the newest checkpoint and replays a write-ahead record that is newer,
so a crash between 2 and 3 still yields exactly one step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gyre.errors import FailedPrecondition, InvalidArgument
from gyre.failpoints import FAILPOINT_ENV, FailpointCrash, failpoint
from services.cell_agent.training.checkpoint import Checkpointer, CheckpointRecord, PendingStep
from services.cell_agent.training.trainer import Trainer

log = logging.getLogger(__name__)
__all__ = ["FAILPOINT_ENV", "CoreOptimizer", "FailpointCrash", "OptimConfig", "StepResult", "failpoint"]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step command did."""

    batch_id: int
    version: int
    applied: bool
    tokens: int = 0
    grad_norm: float = 0.0


class CoreOptimizer:
    """AdamW over a :class:`Trainer`'s parameters, one step per batch id."""

    def __init__(self, trainer: Trainer, cfg: OptimConfig, checkpointer: Checkpointer | None = None) -> None:
        self.trainer = trainer
        self.cfg = cfg
        self.ckpt = checkpointer
        self.opt = torch.optim.AdamW(
            trainer.params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
        self.last_batch_id = 0
        self.steps = 0

    @property
    def version(self) -> int:
        return self.trainer.version

    def restore(self) -> bool:
        """Loads the newest checkpoint and replays a newer write-ahead record. Returns True
        when any state was restored."""
        if self.ckpt is None:
            return False
        rec = self.ckpt.latest()
        restored = False
        if rec is not None:
            self.trainer.load_state(rec.model, rec.version)
            self.opt.load_state_dict(rec.optimizer)
            self.last_batch_id, self.steps = rec.batch_id, rec.steps
            restored = True
            log.info("restored checkpoint", extra={"version": rec.version, "batch_id": rec.batch_id})
        for p in self.ckpt.pending():
            if p.batch_id <= self.last_batch_id:
                self.ckpt.drop_pending(p.batch_id)  # committed before the crash
            elif p.base_version == self.version:
                log.warning("replaying uncommitted step", extra={"batch_id": p.batch_id})
                self.step(p.batch_id, p.grad_sum, p.tokens, write_ahead=False)
                restored = True
            else:
                log.error("dropping write-ahead record on another version", extra={"batch_id": p.batch_id})
                self.ckpt.drop_pending(p.batch_id)
        return restored

    def step(
        self, batch_id: int, grad_sum: torch.Tensor, tokens: int, write_ahead: bool = True
    ) -> StepResult:
        """Normalizes ``grad_sum`` (the reduced sum over every participant) by ``tokens``,
        clips, steps once and records it. Idempotent per batch id."""
        if batch_id <= 0:
            raise InvalidArgument("batch ids start at 1")
        if batch_id <= self.last_batch_id:
            log.info("duplicate step refused (no-op)", extra={"batch_id": batch_id})
            return StepResult(batch_id, self.version, applied=False)
        if self.trainer.window_version not in (None, self.version):
            raise FailedPrecondition("gradient window on another version")
        numel = sum(p.numel() for p in self.trainer.params)
        if grad_sum.numel() != numel:
            raise InvalidArgument(f"gradient has {grad_sum.numel()} values, model {numel}")
        if not torch.isfinite(grad_sum).all():
            raise InvalidArgument(f"non-finite gradient for batch {batch_id}")
        base = self.version
        # 1. Write-ahead.
        if self.ckpt is not None and write_ahead:
            self.ckpt.write_pending(PendingStep(batch_id, base, grad_sum.detach().cpu(), tokens))
        failpoint("training.after_write_ahead")
        # 2. Normalize by the batch's tokens, clip, one step.
        norm = 0.0
        if tokens > 0:
            offset = 0
            for p in self.trainer.params:
                n = p.numel()
                p.grad = (grad_sum[offset : offset + n].view_as(p) / tokens).to(p.device, p.dtype)
                offset += n
            norm = float(
                torch.nn.utils.clip_grad_norm_(self.trainer.params, self.cfg.max_grad_norm, foreach=False)
            )
            self.opt.step()
            self.steps += 1
        self.opt.zero_grad(set_to_none=True)
        self.trainer.window_version = None
        self.trainer.tokens = 0
        self.trainer.version = base + 1 if tokens > 0 else base
        self.last_batch_id = batch_id
        failpoint("training.after_step")
        # 3. The step's record.
        if self.ckpt is not None:
            self.ckpt.save(self.record())
            self.ckpt.drop_pending(batch_id)
        failpoint("training.after_checkpoint")
        return StepResult(batch_id, self.version, applied=tokens > 0, tokens=tokens, grad_norm=norm)

    def record(self) -> CheckpointRecord:
        return CheckpointRecord(
            version=self.version,
            batch_id=self.last_batch_id,
            model={k: v.detach().cpu().clone() for k, v in self.trainer.state_dict().items()},
            optimizer=self.opt.state_dict(),
            steps=self.steps,
        )
