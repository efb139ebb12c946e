"""A router with neither router.max_turn_tokens nor a known model context (a tokenizer
without config.json) still bounds a turn: a prompt past the default turn limit (8192, the
packer's default budget) is a fast 400 naming the limit, before any engine sees it and
without a turn record (before, such a turn went to the engine and its record was refused
by the packer, which the harness never heard of); a call below it has max_tokens cut to the
room left, ends with "length", and its turn is recorded."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from services.router.limits import DEFAULT_TURN_TOKENS
from testkit.fake_engine import FakeOptions
from testkit.router_env import RouterEnv

pytestmark = pytest.mark.timeout(120)


async def test_an_oversized_turn_is_refused_without_max_turn_tokens(etcd_server, tmp_path):
    engines = [FakeOptions(cell_id="a", token_delay_s=0.001)]
    async with RouterEnv(etcd_server.endpoint, tmp_path, "rt", engines=engines, model="tiny") as env:
        ex, token = await env.routed("a")
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [20] * DEFAULT_TURN_TOKENS, "max_tokens": 8}
            async with s.post(f"{env.url}/completions", json=body, headers=headers) as r:
                text = await r.text()
                assert r.status == 400, text
                assert "trainable turn" in text and str(DEFAULT_TURN_TOKENS) in text
            assert env.engine.engine.requests == [] and env.packer.turns == {}
            for _ in range(100):  # the route arrives through the router's watch
                body = {"prompt": [20] * (DEFAULT_TURN_TOKENS - 4), "max_tokens": 8}
                async with s.post(f"{env.url}/completions", json=body, headers=headers) as r:
                    data = await r.json()
                if r.status == 200:
                    break
                await asyncio.sleep(0.1)
            assert r.status == 200, data
            assert data["usage"]["completion_tokens"] == 4  # cut to the room left
            assert data["choices"][0]["finish_reason"] == "length"
        for _ in range(100):
            if env.packer.turns:
                break
            await asyncio.sleep(0.1)
        assert len(env.packer.turns) == 1
