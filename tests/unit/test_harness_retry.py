"""The example harness retries a model call its router lost (sent, no answer: the router
died or restarted mid-call), a bounded number of times, every try with the call's
idempotency key, and counts the calls answered."""

from __future__ import annotations

from typing import Any

import pytest

from apps.harness import example
from apps.harness.env import EnvConfig
from apps.harness.example import HarnessStats, run_execution
from gyre.errors import Unavailable


class FakeExecution:
    """An ExecutionHandle whose router loses the first ``lose`` calls."""

    def __init__(self, lose: int) -> None:
        self.task = ""
        self.task_id = "t-1"
        self.execution_id = "t-1-0"
        self.policy_version = 3
        self.closed_as = ""
        self.lose = lose
        self.calls = 0
        self.keys: list[str | None] = []
        self.finished: dict[str, Any] = {}

    async def __aenter__(self) -> FakeExecution:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def chat_message(self, messages, **kw) -> dict[str, Any]:
        self.calls += 1
        self.keys.append(kw.get("idempotency_key"))
        if self.lose:
            self.lose -= 1
            raise Unavailable("router http://r/v1: ServerDisconnectedError")
        return {"role": "assistant", "content": "42"}

    async def finish(self, reward: float = 0.0, status: str = "ok"):
        self.finished = {"reward": reward, "status": status}

        class Reply:
            duplicate = False

        return Reply()


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(example, "MODEL_CALL_RETRY_S", 0.0)


ENV = EnvConfig(turns_median=1, turns_sigma=0, turns_max=1, time_scale=0)


async def test_a_lost_model_call_is_retried_and_the_episode_completes():
    ex, stats = FakeExecution(lose=example.MODEL_CALL_TRIES - 1), HarnessStats()
    await run_execution(ex, ENV, stats)
    assert ex.calls == example.MODEL_CALL_TRIES and stats.calls == 1
    (key,) = set(ex.keys)  # every try of the call: one key, so the packer keeps one turn
    assert key
    assert (stats.completed, stats.failed) == (1, 0) and ex.finished["status"] == "ok"


async def test_a_call_lost_on_every_try_fails_the_episode():
    ex, stats = FakeExecution(lose=example.MODEL_CALL_TRIES), HarnessStats()
    await run_execution(ex, ENV, stats)
    assert ex.calls == example.MODEL_CALL_TRIES and stats.calls == 0
    assert (stats.completed, stats.failed) == (0, 1) and ex.finished["status"] == "failed"
