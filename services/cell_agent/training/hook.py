"""The cell agent's training hook (``services.cell_agent.hooks.TrainingHook``) on a
:class:`~services.cell_agent.training.service.TrainingService`, and :func:`build_hook`, the
factory the cell agent's ``__main__`` looks for.

Settings are the cell agent's typed ``training`` section (``cell_agent.training`` in the
YAML, ``GYRE_CELL_AGENT__TRAINING__<FIELD>``, ``--set training.<field>=...``). A cell trains
when that section exists and does not say ``enabled: false``; an empty ``model_dir`` falls
back to the cell's own ``model_dir``; disabled, or with no model at all (a mock cluster),
the cell gets the no-op hook. ``mode: mock`` gives the cost-model trainer. A trainer
that fails to start (bad settings, a rendezvous that never completes) does not take the
cell down: JoinBatch answers UNAVAILABLE with the reason and rollout goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gyre.history import History
from gyre.runtime import Runtime
from services.cell_agent import snapshots
from services.cell_agent.config import CellAgentConfig
from services.cell_agent.hooks import NoopTrainingHook, TrainingHook
from services.cell_agent.training.config import MockTrainerSettings, TrainingSettings
from services.cell_agent.training.service import TrainingService

log = logging.getLogger(__name__)


class CellTrainingHook:
    """What the cell calls around its training role."""

    def __init__(self, service: TrainingService, leave_timeout_s: float = 600.0) -> None:
        self.service = service
        self.leave_timeout_s = leave_timeout_s

    async def on_enter_training(self) -> None:
        await self.service.on_enter_training()

    async def on_leave_training(self) -> None:
        # Leaving training drains the batch in progress (its step and broadcast) first.
        await self.service.on_leave_training(self.leave_timeout_s)

    async def join_batch(self, cmd: Any) -> bool:
        return await self.service.join_batch(
            cmd.batch_id, cmd.policy_version, cmd.prefix_size, cmd.core_target
        )

    def services(self) -> Sequence[tuple[Any, Any, str]]:
        return [snapshots.registration(self.service.snapshots)]


def load_settings(cfg: CellAgentConfig) -> TrainingSettings:
    """The real trainer's settings of a cell agent (disabled without a ``training`` section)."""
    settings = cfg.training
    if not isinstance(settings, TrainingSettings):
        return TrainingSettings(enabled=False)  # no section (this cluster does not train), or mock
    if not settings.model_dir and cfg.model_dir:
        settings = settings.model_copy(update={"model_dir": cfg.model_dir})
    return settings


def build_hook(rt: Runtime, cfg: CellAgentConfig, history: History | None = None) -> TrainingHook:
    """The cell agent's training hook: a real trainer for an elastic cell with a model, the
    cost-model trainer for ``mode: mock``, the no-op hook otherwise. Spawns the background
    build under the runtime's supervisor. Both trainers write their part of the cell's
    ``history`` (joins, micro-steps trained and acknowledged, steps, publications)."""
    if cfg.kind != "elastic" or cfg.index < 0:
        return NoopTrainingHook()

    def wiring() -> dict[str, Any]:
        """What either trainer needs of its cell: who it is, where it listens, etcd, its history."""
        return {
            "cell_id": cfg.cell_id,
            "index": cfg.index,
            "target": lambda: rt.target,
            "etcd": rt.etcd,
            "keys": rt.keys,
            "history": history,
        }

    if isinstance(cfg.training, MockTrainerSettings):  # the cost-model trainer of the emulated cluster
        from services.cell_agent.training.mock_trainer import MockTrainingHook

        if not cfg.training.enabled:
            return NoopTrainingHook()
        settings_mock = cfg.training
        if not settings_mock.initial_policy_version and cfg.policy_version:
            settings_mock = settings_mock.model_copy(update={"initial_policy_version": cfg.policy_version})
        return MockTrainingHook(settings_mock, **wiring())
    settings = load_settings(cfg)
    if not settings.enabled:
        return NoopTrainingHook()
    if not settings.model_dir:
        log.info("no model_dir: this cell does not train (no-op training hook)")
        return NoopTrainingHook()
    service = TrainingService(settings, **wiring())
    rt.supervisor.spawn("training", service.run())
    return CellTrainingHook(service)
