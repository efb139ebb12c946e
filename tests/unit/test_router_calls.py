"""A model call survives moves and engine failures as an exact continuation: the tokens the
harness receives equal those of one uninterrupted engine (none duplicated, none lost), on
the same policy version; past the retry budget, without a route, on a hung engine or past
the deadline it ends with a clean error, never a hang; a cancelled call aborts its engine
request; the KV handoff exports at the source, imports at the destination and releases
after the destination's first token (recomputing on export failure)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from gyre.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from gyre.tokens import Chunk, FinishReason
from services.router.calls import CallPolicy, RouterStats
from services.router.engine import EngineRequest, KvHandle, Sampling
from services.router.failures import FailureReporter
from services.router.manager import CallManager
from services.router.routes import Route, RouteTable
from services.router.turns import Turn, TurnRecorder
from testkit.fake_engine import context_state, next_state, reference, token_for

PROMPT = [5, 6, 7, 8]


@dataclasses.dataclass
class Script:
    policy_version: int = 1
    delay_s: float = 0.001
    per_chunk: int = 1
    fail_after: int = 0  # raise Unavailable after this many tokens (once per target)
    hang_after: int = 0
    export_ok: bool = True
    export_delay_s: float = 0.0
    short_logprobs: int = 0  # the first this many chunks lack their last token's log-prob


class FakeEngines:
    """In-memory engines keyed by target, same token function as the gRPC fake."""

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts
        self.requests: list[tuple[str, EngineRequest]] = []
        self.aborts: list[tuple[str, str]] = []
        self.cancelled: list[str] = []
        self.exports: list[str] = []
        self.releases: list[tuple[str, str]] = []
        self.tokens_sent: dict[str, int] = {}

    async def generate(self, target: str, request: EngineRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        s = self.scripts[target]
        self.requests.append((target, request))
        if request.required_policy_version and request.required_policy_version != s.policy_version:
            raise FailedPrecondition("policy version mismatch")
        state = context_state(s.policy_version, list(request.prompt_token_ids))
        sent = 0
        try:
            while sent < request.sampling.max_tokens:
                ids, lps = [], []
                finish = None
                for _ in range(s.per_chunk):
                    tok, lp = token_for(state, 512)
                    state = next_state(state, tok)
                    ids.append(tok)
                    lps.append(lp)
                    if tok in request.sampling.stop_token_ids:
                        finish = FinishReason.STOP
                        break
                    if sent + len(ids) >= request.sampling.max_tokens:
                        finish = FinishReason.LENGTH
                        break
                await asyncio.sleep(s.delay_s)
                if s.short_logprobs:
                    s.short_logprobs -= 1
                    lps = lps[:-1]  # an engine that answered a token without its log-prob
                yield Chunk(ids, lps, s.policy_version, finish)
                sent += len(ids)
                self.tokens_sent[request.request_id] = sent
                if s.fail_after and sent >= s.fail_after:
                    s.fail_after = 0
                    raise Unavailable("engine died")
                if s.hang_after and sent >= s.hang_after:
                    await asyncio.Event().wait()
                if finish:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            raise

    async def abort(self, target: str, request_id: str, timeout_s: float) -> None:
        self.aborts.append((target, request_id))

    async def export_kv(self, target: str, request_id: str, timeout_s: float) -> KvHandle | None:
        s = self.scripts[target]
        self.exports.append(request_id)
        await asyncio.sleep(s.export_delay_s)
        if not s.export_ok:
            return None
        return KvHandle(f"h-{request_id}", target, self.tokens_sent.get(request_id, 0), "shm://x", "shm")

    async def release_kv(self, target: str, handle_id: str, timeout_s: float) -> None:
        self.releases.append((target, handle_id))


class AttachingEngines(FakeEngines):
    """The same engines behind ``attach`` (the GenerateStream client's interface): the
    engine's side calls the attempt back with each chunk (no finish reason on it) and ends
    it once with the finish or the error; detaching cancels the engine request."""

    def attach(self, target: str, request: EngineRequest, timeout_s: float, sink) -> object:
        async def feed() -> None:
            finish = None
            try:
                async for chunk in self.generate(target, request, timeout_s):
                    finish = chunk.finish_reason
                    sink.on_chunk(Chunk(chunk.token_ids, chunk.logprobs, chunk.policy_version))
            except Unavailable as exc:
                sink.on_end(None, exc)
            except FailedPrecondition as exc:
                sink.on_end(None, exc)
            else:
                sink.on_end(finish, None)

        task = asyncio.get_running_loop().create_task(feed())
        return task.cancel


ENGINE_CLIENTS = {"iterate": FakeEngines, "attach": AttachingEngines}


@pytest.fixture(autouse=True, params=sorted(ENGINE_CLIENTS))
def engine_client(request, monkeypatch):
    """Every test runs against both ways a call reads an engine: iterating its chunks (one
    Generate call per request) and being called back (the GenerateStream client)."""
    monkeypatch.setattr(Setup, "engines", ENGINE_CLIENTS[request.param])
    return request.param


class Sink:
    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def record(self, turn: Turn) -> None:
        self.turns.append(turn)


def route(cell: str, epoch: int, token_hash: str = "ab" * 32) -> Route:
    return Route("e1", cell, cell, token_hash, "g1", 1, 1, epoch, created_revision=10)


class Setup:
    engines: type[FakeEngines] = FakeEngines


def setup(
    scripts: dict[str, Script], **policy: object
) -> tuple[CallManager, RouteTable, FakeEngines, Sink, TurnRecorder]:
    table = RouteTable()
    table.apply(route("a", 1))
    engines = Setup.engines(scripts)
    sink = Sink()
    turns = TurnRecorder(sink=sink)
    pol = CallPolicy(**{"failover_wait_s": 0.05, "engine_idle_timeout_s": 5.0, **policy})  # type: ignore[arg-type]
    mgr = CallManager(routes=table, engines=engines, policy=pol, turns=turns, stats=RouterStats())
    return mgr, table, engines, sink, turns


async def run_call(
    mgr: CallManager, max_tokens: int, on_tokens=None, timeout_s: float = 10.0, stop=()
) -> tuple[list[int], list[Chunk]]:
    out: list[int] = []
    chunks: list[Chunk] = []
    r = mgr.routes.get("e1")
    assert r is not None
    async for chunk in mgr.generate(
        r, PROMPT, Sampling(max_tokens=max_tokens, stop_token_ids=tuple(stop)), timeout_s
    ):
        out.extend(chunk.token_ids)
        chunks.append(chunk)
        if on_tokens is not None:
            await on_tokens(len(out))
    return out, chunks


async def test_unmoved_call_matches_reference_and_records_turn():
    mgr, _, engines, sink, turns = setup({"a": Script()})
    task = asyncio.create_task(turns.run())
    out, chunks = await run_call(mgr, 20)
    assert out == reference(1, PROMPT, 20)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert await turns.flush(2.0)
    assert len(sink.turns) == 1 and list(sink.turns[0].output_token_ids) == out
    assert sink.turns[0].output_policy_versions == (1,) * 20 and sink.turns[0].turn_index == 0
    task.cancel()


@pytest.mark.parametrize("moves", [1, 3])
async def test_moved_call_is_token_identical(moves):
    cells = ["a", "b", "c", "d"]
    mgr, table, engines, sink, _ = setup({c: Script(per_chunk=2) for c in cells})
    done_moves = 0

    async def on_tokens(n: int) -> None:
        nonlocal done_moves
        if done_moves < moves and n >= 4 * (done_moves + 1):
            done_moves += 1
            table.apply(route(cells[done_moves], done_moves + 1))

    out, _ = await run_call(mgr, 30, on_tokens)
    assert out == reference(1, PROMPT, 30)
    assert done_moves == moves
    assert mgr.stats.moves == moves
    targets = [t for t, _ in engines.requests]
    assert targets == cells[: moves + 1]
    # Every source attempt was aborted; continuations carry prompt + generated tokens.
    assert [t for t, _ in engines.aborts] == cells[:moves]
    for _, req in engines.requests[1:]:
        assert list(req.prompt_token_ids[: len(PROMPT)]) == PROMPT
        generated = list(req.prompt_token_ids[len(PROMPT) :])
        assert generated == out[: len(generated)]
        assert req.sampling.max_tokens == 30 - len(generated)
        assert req.required_policy_version == 1


async def test_move_via_manager_waits_for_source_stop():
    mgr, table, engines, _, _ = setup({"a": Script(delay_s=0.01), "b": Script(delay_s=0.01)})
    result: dict[str, object] = {}

    async def on_tokens(n: int) -> None:
        if n == 3:
            table._routes["e1"] = route(
                "b", 2
            )  # table updated without listeners (as a MoveExecutions would find it)
            result["move"] = await mgr.move(["e1"], {"a"})

    out, _ = await run_call(mgr, 12, on_tokens)
    assert out == reference(1, PROMPT, 12)
    assert result["move"] == (1, 0)


async def test_engine_failure_with_budget_completes_identically():
    mgr, table, engines, _, _ = setup({"a": Script(fail_after=5), "b": Script()}, retry_budget=1)

    async def on_tokens(n: int) -> None:
        return None

    # The scheduler moves the route shortly after the failure.
    async def mover() -> None:
        while not engines.aborts:
            await asyncio.sleep(0.001)
        table.apply(route("b", 2))

    m = asyncio.create_task(mover())
    out, _ = await run_call(mgr, 15, on_tokens)
    await m
    assert out == reference(1, PROMPT, 15)
    assert mgr.stats.engine_failures == 1
    assert [t for t, _ in engines.requests] == ["a", "b"]


async def test_engine_failure_retries_same_route_when_not_moved():
    mgr, _, engines, _, _ = setup({"a": Script(fail_after=5)}, retry_budget=1)
    out, _ = await run_call(mgr, 15)
    assert out == reference(1, PROMPT, 15)
    assert [t for t, _ in engines.requests] == ["a", "a"]


async def test_engine_failure_without_budget_is_a_clean_error():
    mgr, _, _, _, turns = setup({"a": Script(fail_after=5)}, retry_budget=0)
    got: list[int] = []
    with pytest.raises(Unavailable, match="retry budget 0"):
        async for chunk in mgr.generate(mgr.routes.get("e1"), PROMPT, Sampling(max_tokens=15), 5.0):
            got.extend(chunk.token_ids)
    assert got == reference(1, PROMPT, 5)
    assert mgr.stats.failed_calls == 1 and mgr.stats.inflight == 0
    assert turns.pending == 0  # a failed call records no turn


async def test_destination_on_another_policy_version_is_refused():
    mgr, table, engines, _, _ = setup({"a": Script(), "b": Script(policy_version=2)}, retry_budget=0)

    async def on_tokens(n: int) -> None:
        if n == 3:
            table.apply(route("b", 2))

    with pytest.raises(Unavailable, match="policy version"):
        await run_call(mgr, 12, on_tokens)
    assert engines.requests[-1][1].required_policy_version == 1


async def test_no_route_is_a_clean_error():
    mgr, table, _, _, _ = setup({"a": Script()})
    r = table.get("e1")
    table.remove("e1")
    with pytest.raises(Unavailable, match="no route"):
        async for _ in mgr.generate(r, PROMPT, Sampling(max_tokens=5), 5.0):
            pass


async def test_a_closed_execution_ends_its_running_call_and_aborts_the_engine_request():
    """The scheduler cancels an execution (its route key is deleted) while a call runs: the
    call ends at once with FAILED_PRECONDITION naming the closed execution, and the engine
    request is aborted (its slot returns)."""
    mgr, table, engines, _, _ = setup({"a": Script(delay_s=0.01)})

    async def close_after(n: int) -> None:
        if n >= 5:
            table.remove("e1")

    with pytest.raises(FailedPrecondition, match="e1 was closed by the scheduler"):
        await asyncio.wait_for(run_call(mgr, 1000, on_tokens=close_after), 5)
    await asyncio.sleep(0.01)
    rid = engines.requests[0][1].request_id
    assert ("a", rid) in engines.aborts and len(engines.requests) == 1
    assert mgr.stats.closed_calls == 1 and mgr.stats.inflight == 0


async def test_hung_engine_becomes_an_error_not_a_hang():
    mgr, _, _, _, _ = setup({"a": Script(hang_after=3)}, retry_budget=0, engine_idle_timeout_s=0.2)
    with pytest.raises(Unavailable, match="sent nothing"):
        await asyncio.wait_for(run_call(mgr, 10), 5)


async def test_deadline_is_enforced():
    mgr, _, engines, _, _ = setup({"a": Script(delay_s=0.05)})
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(run_call(mgr, 100, timeout_s=0.2), 5)
    await asyncio.sleep(0.01)
    assert engines.aborts, "a call past its deadline aborts its engine request"


async def test_cancelled_call_aborts_engine_request():
    mgr, _, engines, _, _ = setup({"a": Script(delay_s=0.01)})
    task = asyncio.create_task(run_call(mgr, 1000))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    rid = engines.requests[0][1].request_id
    assert rid in engines.cancelled
    assert ("a", rid) in engines.aborts
    assert mgr.stats.inflight == 0


async def test_stop_token_ends_call_and_nothing_follows():
    ref = reference(1, PROMPT, 50)
    stop = ref[6]
    mgr, _, _, _, _ = setup({"a": Script(per_chunk=4)})
    out, chunks = await run_call(mgr, 50, stop=[stop])
    assert out == ref[: ref.index(stop) + 1]
    assert chunks[-1].finish_reason is FinishReason.STOP


async def test_kv_handoff_exports_imports_and_releases():
    mgr, table, engines, _, _ = setup({"a": Script(), "b": Script()}, kv_handoff=True)

    async def on_tokens(n: int) -> None:
        if n == 4:
            table.apply(route("b", 2))

    out, _ = await run_call(mgr, 12, on_tokens)
    await asyncio.sleep(0.01)
    assert out == reference(1, PROMPT, 12)
    src_req = engines.requests[0][1]
    dst_req = engines.requests[1][1]
    assert engines.exports == [src_req.request_id]
    assert dst_req.kv_handle is not None and dst_req.kv_handle.handle_id == f"h-{src_req.request_id}"
    assert engines.releases == [("a", dst_req.kv_handle.handle_id)]
    assert mgr.stats.kv_handoffs == 1 and mgr.stats.kv_recomputes == 0


async def test_kv_export_timeout_falls_back_to_recompute():
    mgr, table, engines, _, _ = setup(
        {"a": Script(delay_s=0.02, export_delay_s=0.5), "b": Script()}, kv_handoff=True, kv_timeout_s=0.05
    )

    async def on_tokens(n: int) -> None:
        if n == 4:
            table.apply(route("b", 2))

    out, _ = await run_call(mgr, 12, on_tokens)
    assert out == reference(1, PROMPT, 12)
    assert engines.requests[1][1].kv_handle is None
    assert mgr.stats.kv_handoffs == 0 and mgr.stats.kv_recomputes == 1


@pytest.mark.parametrize("kv", [False, True])
async def test_rapid_successive_moves_end_at_the_latest_route(kv):
    cells = ["a", "b", "c", "d"]
    mgr, table, engines, _, _ = setup({c: Script(delay_s=0.002) for c in cells}, kv_handoff=kv)
    fired = False

    async def on_tokens(n: int) -> None:
        nonlocal fired
        if n >= 5 and not fired:
            fired = True
            for i, cell in enumerate(cells[1:], start=2):  # three moves within one loop turn
                table.apply(route(cell, i))

    out, _ = await run_call(mgr, 25, on_tokens)
    assert out == reference(1, PROMPT, 25)
    targets = [t for t, _ in engines.requests]
    assert targets[0] == "a" and targets[-1] == "d"
    assert len(targets) <= 4


async def test_move_while_waiting_after_a_failure_goes_to_the_new_route():
    mgr, table, engines, _, _ = setup(
        {"a": Script(fail_after=4), "b": Script()}, retry_budget=1, failover_wait_s=5.0
    )

    async def mover() -> None:
        while not engines.aborts:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)  # the call is now waiting for a new route
        table.apply(route("b", 2))

    m = asyncio.create_task(mover())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out, _ = await run_call(mgr, 12)
    await m
    assert out == reference(1, PROMPT, 12)
    assert loop.time() - t0 < 2.0  # woken by the route change, not by failover_wait_s
    assert [t for t, _ in engines.requests] == ["a", "b"]


async def test_coalescing_window_merges_tokens_without_changing_them():
    mgr, _, _, _, _ = setup({"a": Script(delay_s=0.002)}, coalesce_s=0.02)
    out, chunks = await run_call(mgr, 30)
    assert out == reference(1, PROMPT, 30)
    assert len(chunks) < 15  # ~10 tokens per message instead of 1
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert len(chunks[0].token_ids) == 1  # the first token is not held: no window before it


def _reference_logprobs(prompt: list[int], n: int, version: int = 1) -> tuple[float, ...]:
    state, out = context_state(version, prompt), []
    for _ in range(n):
        tok, lp = token_for(state, 512)
        out.append(lp)
        state = next_state(state, tok)
    return tuple(out)


async def test_a_chunk_short_of_logprobs_fails_the_attempt_and_the_retry_records_real_ones():
    """No log-prob is made up: the attempt whose engine answered a token without one fails
    (an engine failure, retried within the budget) and takes none of that chunk's tokens;
    the turn recorded has the engine's own log-prob for every token."""
    mgr, _, engines, sink, turns = setup({"a": Script(per_chunk=2, short_logprobs=1)}, retry_budget=1)
    task = asyncio.create_task(turns.run())
    out, chunks = await run_call(mgr, 10)
    assert out == reference(1, PROMPT, 10)
    assert [lp for c in chunks for lp in c.logprobs] == list(_reference_logprobs(PROMPT, 10))
    assert mgr.stats.engine_failures == 1 and [t for t, _ in engines.requests] == ["a", "a"]
    assert engines.aborts == [("a", engines.requests[0][1].request_id)]
    assert await turns.flush(2.0)
    assert len(sink.turns) == 1
    assert sink.turns[0].output_logprobs == _reference_logprobs(PROMPT, 10)
    task.cancel()


async def test_an_engine_without_logprobs_fails_the_call_and_records_nothing():
    mgr, _, _, sink, turns = setup({"a": Script(short_logprobs=1 << 30)}, retry_budget=1)
    task = asyncio.create_task(turns.run())
    got: list[int] = []
    with pytest.raises(Unavailable, match="log-prob") as err:
        async for chunk in mgr.generate(mgr.routes.get("e1"), PROMPT, Sampling(max_tokens=8), 5.0):
            got.extend(chunk.token_ids)
    assert "retry budget 1" in str(err.value)
    assert got == [] and mgr.stats.engine_failures == 2 and mgr.stats.failed_calls == 1
    assert turns.pending == 0 and sink.turns == []
    task.cancel()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
async def test_the_recorded_turn_carries_the_calls_temperature(temperature):
    mgr, _, _, sink, turns = setup({"a": Script()})
    task = asyncio.create_task(turns.run())
    sampling = Sampling(max_tokens=6, temperature=temperature)
    async for _ in mgr.generate(mgr.routes.get("e1"), PROMPT, sampling, 5.0):
        pass
    assert await turns.flush(2.0)
    assert [t.temperature for t in sink.turns] == [temperature]
    msg = sink.turns[0].to_proto()
    assert msg.HasField("temperature") and msg.temperature == temperature
    assert Turn.from_proto(msg) == sink.turns[0]
    task.cancel()


def test_sampled_calls_without_seed_get_distinct_reproducible_seeds():
    """Group members send the same prompt; their sampled calls must not be identical (GRPO
    needs variance), yet each execution's call is reproducible."""
    from services.router.manager import call_seed

    prompt = [5, 6, 7, 8]
    a, b = call_seed("b1-t0-0", prompt), call_seed("b1-t0-1", prompt)
    assert a != b
    assert a == call_seed("b1-t0-0", prompt)
    assert call_seed("b1-t0-0", prompt + [9]) != a
    assert 0 < a < 2**31


class _Scheduler:
    """Stands in for the scheduler leader behind FailureReporter: answers each report."""

    def __init__(self, table: RouteTable, dead: bool) -> None:
        self.table = table
        self.dead = dead
        self.reports: list[tuple[str, str, str]] = []

    async def send(self, cell_id: str, target: str, reason: str) -> bool:
        self.reports.append((cell_id, target, reason))
        await asyncio.sleep(0.01)
        if self.dead:  # the leader found it dead and rerouted at once
            self.table.apply(route("b", 2))
        return self.dead


def _with_reporter(scripts: dict[str, Script], dead: bool, **policy: object):
    mgr, table, engines, _, _ = setup(scripts, **policy)
    sched = _Scheduler(table, dead)
    mgr._reporter = FailureReporter(sched.send)
    return mgr, table, engines, sched


async def test_a_failed_engine_is_reported_and_the_call_continues_at_the_reroute():
    mgr, _, engines, sched = _with_reporter(
        {"a": Script(fail_after=4), "b": Script()}, dead=True, retry_budget=1, failover_wait_s=30.0
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out, _ = await run_call(mgr, 12)
    assert out == reference(1, PROMPT, 12)  # one unbroken response
    assert loop.time() - t0 < 2.0  # the reroute, not failover_wait_s
    assert [r[:2] for r in sched.reports] == [("a", "a")]
    assert [t for t, _ in engines.requests] == ["a", "b"]


async def test_an_engine_the_scheduler_finds_alive_is_retried_at_once():
    mgr, _, engines, sched = _with_reporter(
        {"a": Script(fail_after=4)}, dead=False, retry_budget=1, failover_wait_s=30.0
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out, _ = await run_call(mgr, 12)
    assert out == reference(1, PROMPT, 12)
    assert loop.time() - t0 < 2.0
    assert len(sched.reports) == 1 and [t for t, _ in engines.requests] == ["a", "a"]


async def test_one_report_per_engine_while_it_is_in_flight():
    calls: list[str] = []
    gate = asyncio.Event()

    async def send(cell_id: str, target: str, reason: str) -> bool:
        calls.append(cell_id)
        await gate.wait()
        return True

    reporter = FailureReporter(send, reuse_s=10.0)
    futs = [reporter.report("a", "t", "x") for _ in range(5)]
    gate.set()
    assert await asyncio.gather(*futs) == [True] * 5
    assert await reporter.report("a", "t", "x") is True  # reused within reuse_s
    assert calls == ["a"]


async def test_a_completed_call_ends_once_its_turn_is_recorded():
    gate = asyncio.Event()

    class SlowSink(Sink):
        async def record(self, turn: Turn) -> None:
            await gate.wait()
            await super().record(turn)

    mgr, _, _, _, _ = setup({"a": Script()}, turn_record_wait_s=30.0)
    sink = SlowSink()
    mgr._turns = turns = TurnRecorder(sink=sink)
    task = asyncio.create_task(turns.run())
    call = asyncio.create_task(run_call(mgr, 5))
    await asyncio.sleep(0.2)
    assert not call.done() and not sink.turns  # every token out, the record not yet there
    gate.set()
    out, _ = await call
    assert len(sink.turns) == 1 and list(sink.turns[0].output_token_ids) == out
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# Calls answered once (``whole``: Router.Generate's answer_once, the OpenAI API's JSON) ----------


async def run_whole(mgr: CallManager, max_tokens: int, timeout_s: float = 10.0) -> list[Chunk]:
    r = mgr.routes.get("e1")
    assert r is not None
    return [c async for c in mgr.generate(r, PROMPT, Sampling(max_tokens=max_tokens), timeout_s, whole=True)]


async def when_sent(engines: FakeEngines, n: int) -> None:
    """Until the engines sent ``n`` tokens of the call's requests (a whole call wakes its
    caller at the end only, so tests act from beside it)."""
    while sum(engines.tokens_sent.values()) < n:
        await asyncio.sleep(0.001)


async def test_a_whole_call_moved_mid_call_is_one_token_identical_answer():
    mgr, table, engines, _, _ = setup({"a": Script(), "b": Script()})

    async def move() -> None:
        await when_sent(engines, 5)
        table.apply(route("b", 2))

    mover = asyncio.create_task(move())
    chunks = await run_whole(mgr, 30)
    await mover
    assert len(chunks) == 1 and chunks[0].token_ids == reference(1, PROMPT, 30)
    assert chunks[0].finish_reason is FinishReason.LENGTH and chunks[0].policy_version == 1
    assert [t for t, _ in engines.requests] == ["a", "b"]
    assert mgr.stats.inflight == 0


async def test_a_whole_call_runs_in_its_callers_task(engine_client):
    """No task of the call's own (no runner, no move wait); a pump only for an engine client
    that can only be iterated."""
    mgr, _, engines, _, _ = setup({"a": Script(delay_s=0.002)})
    seen: set[str] = set()

    async def watch() -> None:
        while True:
            seen.update(t.get_name().split(".")[0] for t in asyncio.all_tasks())
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    chunks = await run_whole(mgr, 20)
    watcher.cancel()
    assert chunks[0].token_ids == reference(1, PROMPT, 20)
    assert "call" not in seen
    assert ("pump" in seen) == (engine_client == "iterate")


async def test_a_whole_call_across_a_weight_update_answers_a_chunk_per_policy_version():
    scripts = {"a": Script(delay_s=0.002)}
    mgr, _, engines, _, _ = setup(scripts)

    async def update() -> None:  # the engine's weights change in place mid-request
        await when_sent(engines, 6)
        scripts["a"].policy_version = 2

    updater = asyncio.create_task(update())
    chunks = await run_whole(mgr, 20)
    await updater
    assert [c.policy_version for c in chunks] == [1, 2]
    assert sum(len(c.token_ids) for c in chunks) == 20 and 6 <= len(chunks[0].token_ids) < 20
    assert [c.finish_reason for c in chunks] == [None, FinishReason.LENGTH]


async def test_a_whole_call_past_its_deadline_or_cancelled_ends_cleanly_and_aborts():
    mgr, _, engines, _, _ = setup({"a": Script(delay_s=0.01)})
    with pytest.raises(DeadlineExceeded):
        await run_whole(mgr, 1000, timeout_s=0.1)
    task = asyncio.create_task(run_whole(mgr, 1000))
    await when_sent(engines, 15)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    for _, request in engines.requests:
        assert request.request_id in engines.cancelled and ("a", request.request_id) in engines.aborts
    assert mgr.stats.inflight == 0
