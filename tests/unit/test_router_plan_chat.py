"""Which state a chat call continues (``OpenAIApi._plan_chat``): this router's, when the
history ends with it; the packer's record of the execution's turns when the history has
answers after this router's state and the packer's is later; never an older one from the
packer (any earlier state passes the history check, so the later one must win); and no
packer call for a first call."""

from __future__ import annotations

from typing import Any

from services.router.manager import Resumed
from services.router.tokenization import Tokenizer, normalize_messages
from services.router.trajectory import ChatState, Trajectory, TrajectoryStore, chat_prompt
from testkit.router_env import chat_api


class Manager:
    """The call manager's side of planning: the store, and the packer's answer."""

    def __init__(self, packer: Resumed | None) -> None:
        self.trajectories = TrajectoryStore()
        self.packer = packer
        self.asked = 0
        self.adopted: list[Resumed] = []

    async def resume(
        self, execution_id: str, idempotency_key: str, wait_s: float | None = None
    ) -> Resumed | None:
        self.asked += 1
        return self.packer

    def adopt(self, execution_id: str, resumed: Resumed) -> None:
        self.adopted.append(resumed)
        self.trajectories.install(execution_id, resumed.trajectory)


def _conversation(tok: Tokenizer, n: int) -> tuple[list[dict[str, Any]], list[Trajectory]]:
    """``n`` completed calls (each answered "a<k>"): the history after them and the
    trajectory after each."""
    store = TrajectoryStore()
    end = tok.stop_token_ids[0]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    after = []
    for k in range(n):
        norm = normalize_messages(messages)
        planned = chat_prompt(tok, store.get("x"), norm, [])
        answer = f"a{k}"
        after.append(
            store.record(
                "x", planned.token_ids, tok.encode(answer) + [end], ChatState.of(norm, [], answer, [])
            )
        )
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"u{k}"}]
    return normalize_messages(messages), after


async def test_a_router_with_an_older_state_takes_the_packers_later_one(tok):
    messages, after = _conversation(tok, 2)
    manager = Manager(Resumed(after[1], 2))
    manager.trajectories.install("x", after[0])  # this router served turn 0 only
    planned = await chat_api(manager, tok)._plan_chat("x", "", messages, [])
    assert manager.asked == 1 and manager.adopted and planned.break_reason is None
    assert planned.token_ids[: len(after[1].tokens)] == list(after[1].tokens)


async def test_an_older_state_at_the_packer_never_replaces_this_routers(tok):
    messages, after = _conversation(tok, 2)
    # The history has an answer after this router's state (say, a turn another router
    # served whose record the packer has not got yet), and the packer holds only turn 0.
    messages = normalize_messages([*messages, {"role": "assistant", "content": "prefill"}])
    manager = Manager(Resumed(after[0], 1))
    manager.trajectories.install("x", after[1])
    planned = await chat_api(manager, tok)._plan_chat("x", "", messages, [])
    assert manager.asked == 1 and not manager.adopted
    assert planned.break_reason is None
    assert planned.token_ids[: len(after[1].tokens)] == list(after[1].tokens)


async def test_a_state_the_history_ends_with_and_a_first_call_ask_no_packer(tok):
    messages, after = _conversation(tok, 2)
    manager = Manager(None)
    manager.trajectories.install("x", after[1])
    api = chat_api(manager, tok)
    assert (await api._plan_chat("x", "", messages, [])).break_reason is None
    assert (await api._plan_chat("y", "", [{"role": "user", "content": "hi"}], [])).break_reason == "first"
    assert manager.asked == 0
