"""What the core records after each optimizer step, beside its checkpoint: the step's loss
diagnostics as TensorBoard scalars (``tensorboard --logdir`` over the run folder shows them
next to the demo's reward and evaluation curves), and every N-th version's weights for a
held-out evaluation after the fact (``checkpoint_dir/versions/v<version>.pt``).

Both are best effort: a failed write is logged and never fails the step, which is already
durable in its checkpoint when they run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SCALARS = (
    "clip_fraction",
    "behaviour_weight_mean",
    "behaviour_weight_max",
    "behaviour_weight_capped_share",
    "entropy",
    "grad_norm",
    "logprob_gap_lag0",
    "lag_mean",
    "tokens",
)
"""The per-step diagnostics written as ``train/<name>`` scalars (``lag_hist`` becomes
``lag/share_<k>``, the share of the step's tokens generated ``k`` versions before it)."""


class TensorBoardSteps:
    """One TensorBoard event file of the core's steps, x axis = the new policy version."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, version: int, diagnostics: Mapping[str, Any]) -> None:
        for name in SCALARS:
            if name in diagnostics:
                self.writer.add_scalar(f"train/{name}", float(diagnostics[name]), version)
        hist = diagnostics.get("lag_hist") or []
        total = sum(hist) or 1.0
        for k, count in enumerate(hist):
            self.writer.add_scalar(f"lag/share_{k}", float(count) / total, version)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def version_path(directory: str | os.PathLike[str], version: int) -> Path:
    return Path(directory) / "versions" / f"v{version:06d}.pt"


def keep_version(directory: str | os.PathLike[str], version: int, state: Mapping[str, torch.Tensor]) -> Path:
    """Writes ``state`` (a model state dict) as version ``version``'s weights, atomically."""
    path = version_path(directory, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, tmp)
    os.replace(tmp, path)
    return path


def kept_versions(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """The versions kept under ``directory/versions`` by number."""
    root = Path(directory) / "versions"
    if not root.is_dir():
        return {}
    return {int(p.stem[1:]): p for p in sorted(root.glob("v*.pt"))}


def step_recorder(
    *,
    tensorboard_dir: str,
    checkpoint_dir: str,
    keep_every: int,
    state: Callable[[], Mapping[str, torch.Tensor]],
) -> tuple[Callable[[int, Mapping[str, Any]], None], Callable[[], None]]:
    """``(record(version, diagnostics), close())`` for the core's controller."""
    board = TensorBoardSteps(tensorboard_dir) if tensorboard_dir else None

    def record(version: int, diagnostics: Mapping[str, Any]) -> None:
        try:
            if board is not None:
                board.write(version, diagnostics)
            if checkpoint_dir and keep_every and version % keep_every == 0:
                keep_version(checkpoint_dir, version, state())
        except Exception:  # noqa: BLE001 (best effort: the step is durable already)
            log.exception("recording step %d failed", version)

    def close() -> None:
        if board is not None:
            board.close()

    return record, close
