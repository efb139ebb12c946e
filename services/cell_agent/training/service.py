"""What the cell agent holds for training: a :class:`TrainingService` that builds the
trainer, the prefix groups and the controller in the background at start-up (the
rendezvous waits for every elastic cell), serves snapshots from the moment the process is
up, and forwards ``JoinBatch`` and the lifecycle hooks to the controller once it is ready.

Wiring in the cell agent (elastic cells only)::

    training = TrainingService(cfg.training, cell_id=..., index=..., target=rt.target,
                               etcd=rt.etcd, keys=rt.keys)
    services.append(snapshots.registration(training.snapshots))   # WeightSnapshots
    rt.supervisor.spawn("training", training.run())                # after the server is up
    ... JoinBatch -> await training.join_batch(batch_id, version, prefix_size, core_target)
    ... TRAINING entered/left -> await training.on_enter_training() / on_leave_training()
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import torch

from gyre.backoff import Backoff
from gyre.errors import GyreError, Unavailable
from gyre.etcd import Etcd, Keys
from gyre.history import History
from services.cell_agent.snapshots import SnapshotStore, pull_snapshot
from services.cell_agent.training.checkpoint import Checkpointer
from services.cell_agent.training.config import TrainingSettings
from services.cell_agent.training.controller import BatchOutcome, ControllerParams, TrainingController
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.dist import PrefixGroups, StoreMembership
from services.cell_agent.training.packer_client import PackerSource
from services.cell_agent.training.stages import PipelinedTrainer, StageWorkers
from services.cell_agent.training.steplog import step_recorder
from services.cell_agent.training.store import EtcdPolicyPublisher
from services.cell_agent.training.trainer import LossConfig, Trainer

log = logging.getLogger(__name__)


def pick_device(setting: str, index: int) -> torch.device:
    if setting != "auto":
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{index % torch.cuda.device_count()}")
    return torch.device("cpu")


def stage_devices(setting: str, index: int, stages: int) -> list[str]:
    """The devices of a pipelined cell's stages: with CUDA (``auto``) the cell's ``stages``
    consecutive GPUs (cell ``index`` takes GPUs ``index * stages ...``), else ``setting``
    (``auto``: cpu) for every stage."""
    if setting == "auto" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{(index * stages + s) % count}" for s in range(stages)]
    return ["cpu" if setting == "auto" else setting] * stages


class TrainingService:
    """One elastic cell's training half, built in the background."""

    def __init__(
        self,
        settings: TrainingSettings,
        *,
        cell_id: str,
        index: int,
        target: str | Callable[[], str],
        etcd: Etcd | None = None,
        keys: Keys | None = None,
        history: History | None = None,
    ) -> None:
        if index < 0:
            raise ValueError("only elastic cells (index >= 0) train")
        self.settings = settings
        self.history = history
        self.cell_id = cell_id
        self.index = index
        self._target = target
        self.etcd = etcd
        self.keys = keys
        self.snapshots = SnapshotStore(keep=settings.snapshot_keep)
        self.controller: TrainingController | None = None
        self.groups: PrefixGroups | None = None
        self._ready = asyncio.Event()
        self._failed: str | None = None
        """The last failed build, as JoinBatch answers it (its repr: the exception itself
        would keep the build's frames, and with them the core's rendezvous store listening
        on its port, so the next build could not bind it)."""
        self._source: PackerSource | None = None
        self._close_steps: Callable[[], None] | None = None
        self._pipeline: PipelinedTrainer | None = None
        """The trainer of a pipelined cell (``pipeline_stages`` > 1), whose stage workers
        :meth:`keep_groups` restarts when one dies."""
        self.training = False
        """The cell is in TRAINING (between the lifecycle hooks): a batch attempt that failed
        is joined again after the prefix groups are re-formed."""

    @property
    def target(self) -> str:
        """This cell's gRPC target (host:port), once its server is up."""
        return self._target() if callable(self._target) else self._target

    @target.setter
    def target(self, value: str) -> None:
        self._target = value

    async def run(self, retry_base_s: float = 1.0) -> None:
        """Builds everything, then stays up until cancelled (a supervised task). A build that
        fails (the core killed while the prefix groups formed, a peer not up yet) is logged,
        kept as the answer to every JoinBatch meanwhile, and tried again with back-off; it
        never ends the process (the cell still serves rollouts). Before, one failure was
        final: a satellite whose setup met the core's death never trained again, and the
        restarted core waited for it forever.

        Only the failure's repr outlives its ``except``: the exception's frames hold what the
        build made, the core's rendezvous store among them, listening on its port. Kept as
        the answer, and alive through the back-off, it made the next build fail with
        EADDRINUSE, and so every other build after it (the chaos demo's core, restarted while
        a satellite died, never trained again)."""
        try:
            backoff = Backoff(retry_base_s, 30.0)
            while True:
                try:
                    await self.build()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._failed = repr(exc)
                await self._discard()
                delay_s = backoff.next()
                log.error(
                    "training failed to start; retrying",
                    extra={"error": self._failed, "retry_in_s": round(delay_s, 1)},
                )
                self._ready.set()  # JoinBatch answers the failure meanwhile
                await asyncio.sleep(delay_s)
            self._failed = None
            self._ready.set()
            await self.keep_groups()
        finally:
            await self.close()

    async def _discard(self) -> None:
        """Closes what a failed build made, so the next one starts clean."""
        try:
            await self.close()
        except Exception as exc:  # noqa: BLE001 (half-built parts: nothing more to do)
            log.warning("closing a failed training build", extra={"error": repr(exc)})
        self.controller, self.groups, self._source = None, None, None

    async def keep_groups(self, every_s: float = 0.5) -> None:
        """Re-forms the prefix groups after a failed collective, or when a peer asks (a
        restarted satellite, the core's new generation), without an operator; then, in
        training, joins again the batch whose attempt failed."""
        assert self.controller is not None and self.groups is not None
        ctl, groups = self.controller, self.groups
        backoff = Backoff(1.0, 15.0)
        while True:
            await asyncio.sleep(every_s)
            if self._pipeline is not None and self._pipeline.workers.check() is not None:
                await self._restart_stages(ctl, backoff)
                continue
            if groups.world_size <= 1:
                continue
            if ctl.broken is None:
                if not await asyncio.to_thread(groups.wants_reform):
                    continue
                ctl.request_reform("a peer asked for new prefix groups")
            try:
                await ctl.repair(groups.reform)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (a peer not back yet: try again later)
                log.warning("re-forming the prefix groups failed; retrying", extra={"error": repr(exc)})
                await backoff.sleep()
                continue
            if self.training and ctl.broken is None:
                try:
                    await ctl.retry_failed()
                except GyreError as exc:  # the scheduler's next command will do
                    log.warning("joining the failed batch again failed", extra={"error": repr(exc)})

    async def _restart_stages(self, ctl: TrainingController, backoff: Backoff) -> None:
        """A stage worker died: joins are refused and the batch in flight (which failed with
        it) leaves nothing behind; the workers start again from the agent's weights, and in
        training the cell joins again the batch whose attempt failed (the core gets every
        micro-step of it back from the packer)."""
        assert self._pipeline is not None
        pipeline = self._pipeline
        ctl.request_reform(f"pipeline stage died: {pipeline.workers.failed}")
        try:
            await ctl.repair(pipeline.restart_workers)
            backoff.reset()
        except asyncio.CancelledError:
            raise
        except (GyreError, OSError) as exc:  # a worker that failed to start (a device still busy)
            log.warning("restarting the pipeline stages failed; retrying", extra={"error": repr(exc)})
            await backoff.sleep()
            return
        if pipeline.workers.failed is not None:  # a batch was still failing: next round
            return
        log.info("pipeline stages restarted", extra={"cell_id": self.cell_id, "pids": pipeline.workers.pids})
        if self.training and ctl.broken is None:
            try:
                await ctl.retry_failed()
            except GyreError as exc:  # the scheduler's next command will do
                log.warning("joining the failed batch again failed", extra={"error": repr(exc)})

    async def build(self) -> TrainingController:
        s = self.settings
        while self.target.endswith(":0") or not self.target:  # the server is not up yet
            await asyncio.sleep(0.05)
        device = pick_device(s.device, self.index)
        loss = LossConfig(s.clip_eps_low, s.clip_eps_high, s.objective, s.behaviour_weight_cap)
        trainer: Trainer
        if s.pipeline_stages > 1:
            workers = StageWorkers(
                s.model_dir,
                s.pipeline_stages,
                dtype=s.dtype,
                loss=loss,
                devices=stage_devices(s.device, self.index, s.pipeline_stages),
                threads=s.pipeline_threads,
                backend=s.dist_backend,
                cell_id=self.cell_id,
            )
            pipelined = await asyncio.to_thread(
                PipelinedTrainer.with_workers, workers, s.initial_policy_version
            )
            self._pipeline = trainer = pipelined
            device = torch.device("cpu")  # the master copy stays on the host
        else:
            trainer = await asyncio.to_thread(
                Trainer.from_dir, s.model_dir, s.initial_policy_version, s.dtype, str(device), loss
            )
        groups = PrefixGroups(
            rank=self.index,
            world_size=s.world_size,
            master=s.dist_master,
            backend=s.dist_backend,
            device=device,
            timeout_s=s.dist_timeout_s,
            form_timeout_s=s.dist_form_timeout_s,
        )
        await asyncio.to_thread(groups.setup)
        self.groups = groups
        core = None
        if self.index == 0:
            ckpt = Checkpointer(s.checkpoint_dir, s.checkpoint_keep) if s.checkpoint_dir else None
            core = CoreOptimizer(
                trainer,
                OptimConfig(s.lr, (s.beta1, s.beta2), s.eps, s.weight_decay, s.max_grad_norm),
                ckpt,
            )
        publisher = None
        if self.index == 0 and self.etcd is not None and self.keys is not None:
            publisher = EtcdPolicyPublisher(self.etcd, self.keys, self.target)
        on_step = None
        if self.index == 0 and (s.tensorboard_dir or s.keep_versions_every):
            record, self._close_steps = step_recorder(
                tensorboard_dir=s.tensorboard_dir,
                checkpoint_dir=s.checkpoint_dir,
                keep_every=s.keep_versions_every,
                state=trainer.state_dict,
            )

            def on_step(out: BatchOutcome) -> None:
                record(out.new_version, out.diagnostics)

        self._source = PackerSource(s.packer_target, self.cell_id)
        assert groups.store is not None
        self.controller = TrainingController(
            cell_id=self.cell_id,
            index=self.index,
            trainer=trainer,
            snapshots=self.snapshots,
            source=self._source,
            membership=StoreMembership(groups),
            collective=groups,
            publisher=publisher,
            puller=functools.partial(_pull, chunk_bytes=s.snapshot_chunk_bytes, timeout_s=s.pull_timeout_s),
            core=core,
            history=self.history,
            on_step=on_step,
            params=ControllerParams(
                claim_wait_s=s.claim_wait_s,
                join_wait_s=s.join_wait_s,
                collective_timeout_s=s.dist_timeout_s,
                claim_batch=s.claim_batch,
            ),
        )
        await self.controller.start()
        self._ready.set()
        log.info(
            "training ready", extra={"cell_id": self.cell_id, "index": self.index, "version": trainer.version}
        )
        return self.controller

    async def ready(self, timeout_s: float) -> TrainingController:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise Unavailable("training is still starting (waiting for every elastic cell)") from None
        if self.controller is None:
            raise Unavailable(f"training failed to start: {self._failed}")
        return self.controller

    async def join_batch(
        self, batch_id: int, policy_version: int, prefix_size: int, core_target: str
    ) -> bool:
        ctl = await self.ready(self.settings.join_wait_s)
        return await ctl.join_batch(batch_id, policy_version, prefix_size, core_target)

    async def on_enter_training(self) -> None:
        self.training = True
        if self.controller is not None:
            await self.controller.on_enter_training()

    async def on_leave_training(self, timeout_s: float | None = None) -> None:
        self.training = False
        if self.controller is not None:
            await self.controller.on_leave_training(timeout_s)

    async def close(self) -> None:
        if self.controller is not None:
            await self.controller.close()
        if self._source is not None:
            await self._source.close()
        if self.groups is not None:
            await asyncio.to_thread(self.groups.close)
        if self._pipeline is not None:
            await asyncio.to_thread(self._pipeline.close)
            self._pipeline = None
        if self._close_steps is not None:
            self._close_steps()
            self._close_steps = None


async def _pull(target: str, version: int, *, chunk_bytes: int, timeout_s: float):
    return await pull_snapshot(target, version, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
