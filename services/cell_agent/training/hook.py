"""The cell agent's training hook (``services.cell_agent.hooks.TrainingHook``) on a
:class:`~services.cell_agent.training.service.TrainingService`, and :func:`build_hook`, the
factory the cell agent's ``__main__`` looks for.

Settings come from ``cfg.training`` when the cell agent's config has that field (a
:class:`TrainingSettings`), else from the ``training:`` section of the cluster YAML named by
``--config`` / $GYRE_CONFIG with ``GYRE_TRAINING__<FIELD>`` environment overrides. A cell trains when that section (or
``cfg.training``) exists and does not say ``enabled: false``; an empty ``model_dir`` falls
back to the cell's own ``model_dir``;
disabled, or with no model at all (a mock cluster), the cell gets the no-op hook. A trainer
that fails to start (bad settings, a rendezvous that never completes) does not take the
cell down: JoinBatch answers UNAVAILABLE with the reason and rollout goes on.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from gyre import config as config_mod
from services.cell_agent import snapshots
from services.cell_agent.training.config import TrainingSettings
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
        return await self.service.join_batch(cmd.batch_id, cmd.policy_version, cmd.prefix_size, cmd.core_target)

    def services(self) -> Sequence[tuple[Any, Any, str]]:
        return [snapshots.registration(self.service.snapshots)]


def _raw_section() -> tuple[Any, dict[str, Any]]:
    """The ``training:`` section of the cluster YAML (or None) and it with env overrides."""
    path = _config_path()
    raw = (config_mod.read_file(path) if path else {}).get("training")
    section = dict(raw or {})
    prefix = "GYRE_TRAINING__"
    for key, value in os.environ.items():
        if key.startswith(prefix):
            section[key[len(prefix):].lower()] = value
    return raw, section


def load_settings(cfg: Any) -> TrainingSettings:
    """The trainer settings of a cell agent (see the module docstring)."""
    found = getattr(cfg, "training", None)
    if isinstance(found, TrainingSettings):
        settings = found
    else:
        raw, section = _raw_section()
        if raw is None and not section:
            return TrainingSettings(enabled=False)  # no training section: this cluster does not train
        settings = TrainingSettings(**section)
    if not settings.model_dir and getattr(cfg, "model_dir", ""):
        settings = settings.model_copy(update={"model_dir": cfg.model_dir})
    return settings


def _config_path() -> str | None:
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return os.environ.get(config_mod.CONFIG_ENV)


def build_hook(rt: Any, cfg: Any, cell: Any = None) -> Any:
    """The cell agent's training hook: a real trainer for an elastic cell with a model, the
    no-op hook otherwise. Spawns the background build under the runtime's supervisor."""
    from services.cell_agent.hooks import NoopTrainingHook

    if getattr(cfg, "kind", "elastic") != "elastic" or getattr(cfg, "index", -1) < 0:
        return NoopTrainingHook()
    if not isinstance(getattr(cfg, "training", None), TrainingSettings):
        _, section = _raw_section()
        if section.get("mode") == "mock":  # the cost-model trainer of the emulated cluster
            from services.cell_agent.training.mock_trainer import build_mock_hook

            return build_mock_hook(rt, cfg, section)
    settings = load_settings(cfg)
    if not settings.enabled:
        return NoopTrainingHook()
    if not settings.model_dir:
        log.info("no model_dir: this cell does not train (no-op training hook)")
        return NoopTrainingHook()
    service = TrainingService(
        settings, cell_id=cfg.cell_id, index=cfg.index, target=lambda: rt.target, etcd=rt.etcd, keys=rt.keys
    )
    rt.supervisor.spawn("training", service.run())
    return CellTrainingHook(service)
