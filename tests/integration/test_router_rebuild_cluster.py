"""Any router continues any execution exactly (issue 36, item 1), with real processes: a
real packer, two router processes and etcd on loopback, the deterministic fake engine
answering with scripted tokens that do not survive decoding and re-encoding (a prompt
that re-rendered an answer would show).

- A router dies at ``router.turn.recorded`` (the packer holds the call's turn, the harness
  never got the answer); the harness retries the call with its idempotency key at the other
  router, whose link to the packer is cut when the retry arrives and comes back 2.5 s
  later. That router holds nothing of the execution: it waits for the packer, rebuilds the
  token sequence from the turns the packer recorded, and the retry's prompt is the first
  try's, token for token; the packer takes the retry's answer in place of the first try's
  (nothing refused). Before, a GetTrajectory that failed once made it render the history
  afresh: another prompt, refused by the packer for the known key, the turn lost.
- One episode whose calls move between the two routers mid-episode gives exactly the tokens
  (every prompt, every turn the packer holds) of the same episode at one router.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio

from apps.checker import check_files
from gyre.failpoints import EXIT_STATUS, FAILPOINT_FILE_ENV
from testkit import router_packer as rp
from testkit.proxy import LinkProxy
from testkit.router_rig import start_router

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rebuild")
    async with rp.packer_env(etcd_server.endpoint, tmp, "rb") as e:
        link = await LinkProxy(e["packer_target"]).start()  # router 1's link to the packer
        e["rig"].defer(link.stop)
        armed = tmp / "failpoints"
        hist = [tmp / "router0.jsonl", tmp / "router1.jsonl"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(FAILPOINT_FILE_ENV, str(armed))  # router 0 (and its restart) read it
            await e["rig"].add_router("router0", history_file=str(hist[0]))
        # Router 1 reaches the packer through the proxy; a GetTrajectory the cut link swallows
        # fails after 1 s (the deadline of its packer calls) and is asked again.
        await e["rig"].add_router(
            "router1",
            packer_target=link.target,
            rpc_timeout_s=1.0,
            rebuild_wait_s=30.0,
            history_file=str(hist[1]),
        )
        e.update(armed=armed, hist=hist, link=link)
        try:
            yield e
        finally:
            armed.unlink(missing_ok=True)


def _next(messages: list[dict[str, str]], answer: str, k: int) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"go on {k}"}]


async def test_rebuild_a_retry_after_a_router_death_at_turn_recorded_is_accepted(env):
    ex, token, outs = await rp.scripted_execution(env, "hello", "first try", "second try", "more")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    messages = _next(messages, await rp.chat(env, 0, token, messages, "call-0"), 0)
    # Router 0 dies once the packer holds call 1's turn, before the call ends.
    proc0 = env["routers"][0][0]
    env["armed"].write_text("router.turn.recorded\n")
    try:
        with pytest.raises(aiohttp.ClientError):
            await rp.post_chat(env, 0, token, messages, "call-1")
        assert await asyncio.to_thread(proc0.proc.wait, 30) == EXIT_STATUS  # it died there
    finally:
        env["armed"].unlink(missing_ok=True)
    first = await rp.where(env, ex, "call-1")
    assert first.next_turn_index == 1  # the packer holds the first try as turn 1

    # The harness retries at router 1, which never saw the execution and whose link to the
    # packer is cut when the retry arrives, restored 2.5 s later (new connections then).
    env["link"].blackhole()
    retry = asyncio.create_task(rp.chat(env, 1, token, messages, "call-1"))
    await asyncio.sleep(2.5)
    assert not retry.done(), "router 1 answered without the packer"
    env["link"].heal()
    env["link"].reset()
    assert await asyncio.wait_for(retry, 60) == "second try"
    prompts = rp.prompts(env)
    assert len(prompts) == 3
    assert prompts[2] == prompts[1], "the retry's prompt is not its first try's"
    before = prompts[0] + outs[0]
    assert prompts[1][: len(before)] == before
    where = await rp.where(env, ex)
    assert where.next_turn_index == 2 and where.last.turn_index == 1  # replaced, none added
    assert list(where.last.output_token_ids) == outs[2] and where.last.idempotency_key == "call-1"

    # The supervisor restarts router 0, which holds nothing: the next call continues the
    # retry's answer there.
    env["routers"][0] = await asyncio.to_thread(
        start_router, env["cfg"], env["tmp"] / "router0b.log", history_file=str(env["hist"][0])
    )
    messages = _next(messages, "second try", 1)
    assert await rp.chat(env, 0, token, messages, "call-2") == "more"
    prompts = rp.prompts(env)
    before = prompts[2] + outs[2]
    assert prompts[3][: len(before)] == before
    assert (await rp.where(env, ex)).next_turn_index == 3
    # No router had a turn refused. Recorded: 0, the retry of 1, and 2 (router 0 died before
    # its history had the first try of 1).
    verdict = check_files(env["hist"])
    assert verdict.ok, verdict.violations
    assert verdict.counts["turns_refused"] == verdict.counts["turns_dropped"] == 0, verdict.counts
    assert verdict.counts["turns_recorded"] == 3, verdict.counts


async def test_rebuild_moving_calls_between_routers_mid_episode_is_token_identical(env):
    answers = ("hello", "hello world", "the answer is", "Hello, hello!", "say hello")

    async def episode(routers: list[int]) -> tuple[str, list[list[int]]]:
        ex, token, _ = await rp.scripted_execution(env, *answers)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        for k, router in enumerate(routers):
            messages = _next(messages, await rp.chat(env, router, token, messages, f"{ex}-call-{k}"), k)
        return ex, rp.prompts(env)

    if env["routers"][0][0].proc.poll() is not None:  # the test before failed while it was down
        env["routers"][0] = await asyncio.to_thread(
            start_router, env["cfg"], env["tmp"] / "router0c.log", history_file=str(env["hist"][0])
        )
    env["link"].heal()
    one, one_prompts = await episode([0, 0, 0, 0, 0])
    # Moved on every call, and back to a router whose own state is older than the history.
    moved, moved_prompts = await episode([1, 0, 0, 1, 0])
    assert moved_prompts == one_prompts, "a moved execution's prompts differ from one router's"
    for k in range(1, len(answers)):  # and each continues the tokens before it exactly
        before = one_prompts[k - 1] + rp.chars(env["tok"], answers[k - 1])
        assert one_prompts[k][: len(before)] == before, k
    turns = []
    for ex in (one, moved):
        where = await rp.where(env, ex)
        assert where.next_turn_index == len(answers) and where.last.turn_index == len(answers) - 1
        turns.append(
            (list(where.last.prompt_token_ids), list(where.last.output_token_ids), where.last.chat_state)
        )
    assert turns[0] == turns[1]
    verdict = check_files(env["hist"])
    assert verdict.ok, verdict.violations
    assert verdict.counts["turns_refused"] == 0, verdict.counts
