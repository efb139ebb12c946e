"""What one model call may ask for, checked before any engine sees it.

A call's prompt + output must fit the served model's context (``max_model_len``; a longer
prompt would fail at the engine, or worse, be retried there) and, when the router records
turns for training, the packer's micro-step budget (``max_turn_tokens``: a turn longer
than that could never be trained and the packer would refuse its record; unset, the
model's context: :func:`turn_limit`). So a prompt that
leaves no room for one output token is refused at once (HTTP 400 / INVALID_ARGUMENT, with
which limit it hit), and ``max_tokens`` is cut to the room left: the call ends with
``finish_reason: "length"`` there, and its turn is trained like any other.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gyre.errors import InvalidArgument
from gyre.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """Token limits of one model call (0 for a limit means none)."""

    max_prompt_tokens: int
    max_tokens_limit: int
    context_tokens: int = 0
    turn_tokens: int = 0

    def fit(self, prompt_tokens: int, sampling: Sampling) -> Sampling:
        """``sampling`` with ``max_tokens`` cut to the room the prompt leaves; raises
        InvalidArgument when the prompt is empty, too long, or leaves no room."""
        if not 1 <= prompt_tokens <= self.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt must hold 1..{self.max_prompt_tokens} tokens, got {prompt_tokens}"
            )
        bounds = [
            (self.context_tokens, "the model's context (router.max_model_len)"),
            (self.turn_tokens, "a trainable turn (router.max_turn_tokens, the packer's micro-step budget)"),
        ]
        room = sampling.max_tokens
        for limit, what in bounds:
            if not limit:
                continue
            if prompt_tokens >= limit:
                raise InvalidArgument(
                    f"the prompt has {prompt_tokens} tokens; {what} holds {limit} tokens of prompt + output, "
                    "which leaves no room for output"
                )
            room = min(room, limit - prompt_tokens)
        return sampling if room == sampling.max_tokens else dataclasses.replace(sampling, max_tokens=room)


DEFAULT_TURN_TOKENS = 8192
"""The turn limit when neither ``router.max_turn_tokens`` nor the model's context is known:
the packer's default ``micro_step_token_budget``."""


def turn_limit(max_turn_tokens: int, context_tokens: int) -> int:
    """The longest turn (prompt + output) a call may grow: ``router.max_turn_tokens`` when
    set, else the model's context, else :data:`DEFAULT_TURN_TOKENS`. Never "no limit": an
    unbounded turn would pass the router and be refused by the packer, where the harness
    never hears of it (the packer's budget must hold the model's context: apps/limits.py)."""
    return max_turn_tokens or context_tokens or DEFAULT_TURN_TOKENS


def model_context(model_dir: str) -> int:
    """``max_position_embeddings`` of the model's config.json; 0 when unknown."""
    path = Path(model_dir) / "config.json"
    if not model_dir or not path.exists():
        return 0
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings", 0)
    except (ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0
