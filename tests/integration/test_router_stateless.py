"""No router holds state another needs, for chat calls too: the token sequence a chat call
continues (token in, token out) is in every turn record the packer holds, with a digest of
what the call was rendered from and answered, so

- a router that has never seen an execution continues it from the packer's last turn
  (``Packer.GetTrajectory``): the prompt is the previous prompt + exactly the generated
  tokens + the template's delta, not a re-rendering of the history;
- a router whose own state is older than the history (another router served the calls
  since) does the same, and numbers the turn on from the packer's;
- a harness that retries a call at another router with the call's idempotency key gets the
  first try's prompt, and the packer keeps one turn for the call;
- a router restarted with nothing in memory continues as well.

Real router processes, a real packer process and a real etcd; the engine is the
deterministic fake engine (scripted outputs that do not survive decoding and re-encoding,
so a re-rendered history would show)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from testkit import router_packer as rp
from testkit.router_rig import start_router

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stateless")
    async with rp.packer_env(etcd_server.endpoint, tmp, "sl", routers=2) as e:
        yield e


async def test_any_router_continues_a_chat_execution_and_a_retry_keeps_its_turn(env):
    ex, token, outs = await rp.scripted_execution(env, "hello", "world", "again", "first try", "second try")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answers = []
    # Turn 0 at router 0; turn 1 at router 1 (which never saw the execution); turn 2 back at
    # router 0 (whose state is turn 0's: older than the history).
    for turn, router in enumerate((0, 1, 0)):
        answers.append(await rp.chat(env, router, token, messages, f"call-{turn}"))
        messages += [
            {"role": "assistant", "content": answers[-1]},
            {"role": "user", "content": f"go on {turn}"},
        ]
    assert answers == ["hello", "world", "again"]
    prompts = rp.prompts(env)
    for turn in (1, 2):
        before = prompts[turn - 1] + outs[turn - 1]
        assert prompts[turn][: len(before)] == before, f"turn {turn} did not continue the tokens"
    # The packer holds turns 0, 1, 2 (none renumbered past a conflict, none refused).
    where = await rp.where(env, ex)
    assert where.next_turn_index == 3 and where.last.turn_index == 2
    assert list(where.last.prompt_token_ids) == prompts[2] and where.last.chat_state

    # Turn 3 at router 1; the harness did not get the answer and retries at router 0 with
    # the same idempotency key: the same prompt (the turn before the first try's continued),
    # and the packer's turn 3 is the retry's answer (it replaced the first try's).
    first = await rp.chat(env, 1, token, messages, "call-3")
    retried = await rp.chat(env, 0, token, messages, "call-3")
    assert (first, retried) == ("first try", "second try")
    prompts = rp.prompts(env)
    assert prompts[4] == prompts[3]
    assert prompts[3][: len(prompts[2]) + len(outs[2])] == prompts[2] + outs[2]
    where = await rp.where(env, ex)
    assert where.next_turn_index == 4 and where.last.turn_index == 3
    assert list(where.last.output_token_ids) == outs[4]
    # Asked with the call's key, the packer says where the call stood: after turn 2.
    again = await rp.where(env, ex, "call-3")
    assert again.next_turn_index == 3 and again.last.turn_index == 2


async def test_a_restarted_router_continues_from_the_packer(env):
    ex, token, outs = await rp.scripted_execution(env, "hello", "world")
    messages = [{"role": "user", "content": "hi"}]
    answer = await rp.chat(env, 0, token, messages, "r-0")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
    proc, _ = env["routers"][0]
    proc.stop()
    env["routers"][0] = await asyncio.to_thread(start_router, env["cfg"], env["tmp"] / "router0b.log")
    assert await rp.chat(env, 0, token, messages, "r-1") == "world"
    prompts = rp.prompts(env)
    assert prompts[1][: len(prompts[0]) + len(outs[0])] == prompts[0] + outs[0]
    where = await rp.where(env, ex)
    assert where.next_turn_index == 2
