"""Cluster-wide limits, checked when a cluster config is loaded (by the launcher, before
any process starts): the longest trajectory segment the configuration allows must fit one
micro-step and the trained model's context; and the scheduler and the packer must agree on
the staleness bound eta (``max_staleness``) and the rule for groups beyond it
(``stale_rule``).

An execution's tokens only grow (services/router/trajectory.py), and the packer trains each
segment as one sequence (services/packer/segments.py). A segment is as long as its last
call's prompt + output, which is bounded by the engine's context (``cell_agent.max_model_len``)
and by the router's ``max_prompt_tokens + max_tokens_limit``. If the packer's
``micro_step_token_budget`` were smaller, the turns of long episodes would be refused at
RecordTurn (RESOURCE_EXHAUSTED) and never trained; if the model's
``max_position_embeddings`` were smaller, the trainer could not run them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gyre.config import load
from services.cell_agent.config import CellAgentConfig
from services.packer.config import PackerConfig
from services.router.config import RouterConfig
from services.scheduler.config import SchedulerConfig

SHARED = ("max_staleness", "stale_rule")
"""Settings the scheduler and the packer must agree on (set them once, in ``cluster:``)."""


def longest_segment(path: str | os.PathLike[str]) -> int:
    """The most tokens one trajectory segment can reach under the config at ``path``."""
    router = load(RouterConfig, path)
    cell = load(CellAgentConfig, path)
    bounds = [router.max_prompt_tokens + router.max_tokens_limit, cell.max_model_len]
    # The router cuts every call to its own context and turn limits (services/router/limits.py).
    bounds += [n for n in (router.max_model_len, router.max_turn_tokens) if n]
    return min(bounds)


def check_sequence_limits(path: str | os.PathLike[str]) -> int:
    """Raises ValueError when the longest segment does not fit; returns its length."""
    longest = longest_segment(path)
    packer = load(PackerConfig, path)
    if packer.micro_step_token_budget < longest:
        raise ValueError(
            f"{path}: a trajectory segment can grow to {longest} tokens (min of cell_agent.max_model_len and "
            f"router.max_prompt_tokens + router.max_tokens_limit) but packer.micro_step_token_budget is "
            f"{packer.micro_step_token_budget}: raise the budget or lower the limits"
        )
    model_dir = load(CellAgentConfig, path).model_dir
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is not None and config.exists():
        positions = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(positions, int) and positions < longest:
            raise ValueError(
                f"{path}: a trajectory segment can grow to {longest} tokens but the model at {model_dir} "
                f"holds {positions} positions: lower cell_agent.max_model_len"
            )
    return longest


def check_shared_settings(path: str | os.PathLike[str]) -> None:
    """Raises ValueError when the scheduler and the packer disagree on a shared setting
    (the staleness bound eta): the policy would cancel by one bound while the packer drops
    by another."""
    scheduler, packer = load(SchedulerConfig, path), load(PackerConfig, path)
    for name in SHARED:
        a, b = getattr(scheduler, name), getattr(packer, name)
        if a != b:
            raise ValueError(
                f"{path}: scheduler.{name} is {a} but packer.{name} is {b}: set it once, in the "
                f"cluster: section"
            )
