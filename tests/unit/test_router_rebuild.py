"""A router rebuilds an execution's token sequence from the packer's record of its turns
before it builds a chat call's prompt, and waits for the packer to answer: a router that
died at ``router.turn.recorded`` (the packer holds the call's turn, the harness never got
the answer) leaves a retry whose prompt must match its first try token for token, or the
packer refuses it (``idempotency key ... recorded for another prompt``) and the turn is lost.

The retry comes exactly when things restart: the new router's channel to the packer is
being made, the packer may be restarting too or slow under load. Before, a GetTrajectory
that failed once made the router render the history afresh (a router with no state) or
continue its own older state (a router the calls moved back to): another prompt either way.

In process: two routers (each its own CallManager, TurnRecorder and OpenAIApi planning), one
real Packer (in memory), an engine that answers each call with scripted tokens that do not
survive decoding and re-encoding (so a re-rendered history would show)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gyre.errors import Unavailable
from gyre.failpoints import FAILPOINT_ENV, FailpointCrash
from gyre.tokens import Chunk, FinishReason
from services.packer.model import Turn as PackerTurn
from services.packer.packer import Packer
from services.router.calls import CallPolicy
from services.router.engine import EngineRequest, KvHandle, Sampling
from services.router.manager import CallManager
from services.router.routes import Route, RouteTable
from services.router.stops import OutputText
from services.router.tokenization import Tokenizer, normalize_messages
from services.router.trajectory import ChatState
from services.router.turns import Turn, TurnRecorder
from testkit.packer_kit import make_packer
from testkit.router_env import chat_api

EX = "x-1"


class Engine:
    """Answers call n with ``answers[n]`` (then the stop token) and keeps every prompt."""

    def __init__(self, tok: Tokenizer, *answers: str) -> None:
        end = tok.stop_token_ids[0]
        # One character per token: re-encoding the decoded text would merge them.
        self.outputs = [[t for ch in a for t in tok.encode(ch)] + [end] for a in answers]
        self.prompts: list[list[int]] = []

    async def generate(self, target: str, request: EngineRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        self.prompts.append(list(request.prompt_token_ids))
        ids = self.outputs[len(self.prompts) - 1]
        yield Chunk(list(ids), [-0.5] * len(ids), 1, FinishReason.STOP)

    async def abort(self, target: str, request_id: str, timeout_s: float) -> None:
        pass

    async def export_kv(self, target: str, request_id: str, timeout_s: float) -> KvHandle | None:
        return None

    async def release_kv(self, target: str, handle_id: str, timeout_s: float) -> None:
        pass


@dataclasses.dataclass
class PackerLink:
    """A router's RecordTurn and GetTrajectory to the in-memory packer, over the wire forms;
    GetTrajectory goes unanswered (UNAVAILABLE) ``unanswered`` times first."""

    packer: Packer
    unanswered: int = 0
    asked: int = 0

    async def record(self, turn: Turn) -> None:
        await self.packer.record_turn(PackerTurn.from_proto(turn.to_proto(), 1 << 20))

    async def trajectory(self, execution_id: str, idempotency_key: str) -> tuple[Turn | None, int]:
        self.asked += 1
        if self.unanswered > 0:
            self.unanswered -= 1
            raise Unavailable("packer restarting")
        last, index = self.packer.trajectory(execution_id, idempotency_key)
        return (Turn.from_proto(last.to_proto()) if last is not None else None), index


class Router:
    """One router's call path: plan the prompt (``OpenAIApi._plan_chat``), run the call,
    record its turn."""

    def __init__(self, tok: Tokenizer, link: PackerLink, engine: Engine, rebuild_wait_s: float = 5.0) -> None:
        table = RouteTable()
        table.apply(Route(EX, "a", "a", "ab" * 32, "g1", 1, 1, 1, created_revision=10))
        self.turns = TurnRecorder(sink=link, senders=1)
        policy = CallPolicy(turn_record_wait_s=5.0, rebuild_wait_s=rebuild_wait_s)
        self.manager = CallManager(
            routes=table, engines=engine, policy=policy, turns=self.turns, turn_source=link
        )  # type: ignore[arg-type]
        self.api = chat_api(self.manager, tok)
        self.sender = asyncio.get_running_loop().create_task(self.turns.run())
        self.tok = tok

    async def chat(self, messages: list[dict[str, Any]], key: str) -> str:
        """One chat call: its answer's text."""
        norm = normalize_messages(messages)
        planned = await self.api._plan_chat(EX, key, norm, [])
        route = self.manager.routes.get(EX)
        assert route is not None
        sampling = Sampling(max_tokens=32, temperature=0.0, stop_token_ids=tuple(self.tok.stop_token_ids))
        text = ""
        async for chunk in self.manager.generate(
            route,
            planned.token_ids,
            sampling,
            10.0,
            output_text=OutputText(self.tok),
            break_reason=planned.break_reason,
            whole=True,
            idempotency_key=key,
            chat_state=lambda text: ChatState.of(norm, [], text, []),
        ):
            text += chunk.text
        return text

    async def stop(self) -> None:
        self.sender.cancel()
        await asyncio.gather(self.sender, return_exceptions=True)


def _next(messages: list[dict[str, Any]], answer: str, k: int) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"go on {k}"}]


async def test_rebuild_a_retry_after_a_router_death_at_turn_recorded_matches_its_first_try(tok, monkeypatch):
    packer, _, _ = make_packer()
    engine = Engine(tok, "hello", "first try", "second try")
    a = Router(tok, PackerLink(packer), engine)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages = _next(messages, await a.chat(messages, "call-0"), 0)
    # Router A dies once the packer holds call 1's turn, before the call ends: the harness
    # never gets the answer (its sender crashes at the failpoint; A is never used again).
    monkeypatch.setenv(FAILPOINT_ENV, "router.turn.recorded=raise")
    await a.chat(messages, "call-1")
    with pytest.raises(FailpointCrash):
        await a.sender
    monkeypatch.delenv(FAILPOINT_ENV)
    assert packer.trajectory(EX)[1] == 2  # the packer holds turns 0 and 1 (the first try)

    # The harness retries the call, with its key, at a router that holds nothing of the
    # execution and whose first two GetTrajectory calls go unanswered (the packer's channel
    # is being made, or the packer restarts): it waits, rebuilds, and the prompt is the
    # first try's.
    link = PackerLink(packer, unanswered=2)
    b = Router(tok, link, engine)
    assert await b.chat(messages, "call-1") == "second try"
    assert engine.prompts[2] == engine.prompts[1], "the retry's prompt is not its first try's"
    assert link.asked == 3
    assert await b.turns.flush(5.0)
    assert b.turns.rejected == 0 and b.turns.sent == 1, "the packer refused the retry"
    last, index = packer.trajectory(EX)
    assert index == 2 and last is not None and last.turn_index == 1  # replaced, not added
    assert last.output == tuple(engine.outputs[2]) and last.call_key == "call-1"
    assert packer.turns_replaced == 1
    await b.stop()


async def test_rebuild_moves_back_to_a_router_with_an_older_state_waits_for_the_packers(tok):
    packer, _, _ = make_packer()
    engine = Engine(tok, "hello", "world", "again")
    link_a = PackerLink(packer)
    a, b = Router(tok, link_a, engine), Router(tok, PackerLink(packer), engine)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages = _next(messages, await a.chat(messages, "call-0"), 0)
    messages = _next(messages, await b.chat(messages, "call-1"), 1)  # B rebuilds from turn 0
    # Back at A, whose own state (turn 0) is older than the history: the packer's later
    # state wins even when it answers only at the third ask (before, A continued its own
    # older state with turn 1's answer re-rendered: other tokens than turn 1 generated).
    link_a.unanswered = 2
    assert await a.chat(messages, "call-2") == "again"
    before = engine.prompts[1] + engine.outputs[1]
    assert engine.prompts[2][: len(before)] == before, "turn 2 did not continue turn 1's tokens"
    assert await a.turns.flush(5.0) and await b.turns.flush(5.0)
    assert a.turns.rejected == b.turns.rejected == 0 and a.turns.renumbered == 0
    assert packer.trajectory(EX)[1] == 3
    await a.stop()
    await b.stop()


async def test_rebuild_fails_the_call_unavailable_while_the_packer_does_not_answer(tok):
    packer, _, _ = make_packer()
    engine = Engine(tok, "hello", "first try")
    a = Router(tok, PackerLink(packer), engine)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    messages = _next(messages, await a.chat(messages, "call-0"), 0)
    await a.stop()
    # A router that does not hold the execution and cannot reach the packer for longer than
    # its rebuild_wait_s fails the call (the harness retries it) instead of guessing a prompt.
    link = PackerLink(packer, unanswered=1_000_000)
    b = Router(tok, link, engine, rebuild_wait_s=0.3)
    with pytest.raises(Unavailable, match="retry the call"):
        await b.chat(messages, "call-1")
    assert len(engine.prompts) == 1 and link.asked >= 2  # asked again, nothing generated
    assert b.manager.trajectories.resume_failed == 1
    await b.stop()
