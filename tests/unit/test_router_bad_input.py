"""Bad input to the router never becomes a 500: a body nested 100k deep, a lone surrogate
in a string or a key, a seed beyond int64 or a stop id beyond int32 are InvalidArgument
(400); a prompt that leaves no room in the model's context or in a trainable turn is
refused before any engine sees it, and max_tokens is cut to the room left."""

from __future__ import annotations

import pytest

from gyre.errors import InvalidArgument
from gyre.sampling import Sampling
from services.router.http_api import check_json, parse_body
from services.router.limits import DEFAULT_TURN_TOKENS, CallLimits, model_context, turn_limit


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError inside json
        b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}",  # parses, still deeper than allowed
        b'{"a": "x\\ud800y"}',
        b'{"\\udfff": 1}',
        b'{"m": [{"c": ["ok", "\\ud83d"]}]}',  # half of a surrogate pair
        b"[1]",
        b"\xff\xfe",
    ],
)
def test_bad_bodies_are_invalid_argument(raw):
    with pytest.raises(InvalidArgument):
        parse_body(raw)


def test_good_bodies_pass():
    body = parse_body(b'{"messages": [{"role": "user", "content": "h\\u00e9 \\ud83d\\ude00"}]}')
    assert body["messages"][0]["content"] == "hé 😀"
    check_json({"a": [[[[{"b": "ok"}]]]]})


@pytest.mark.parametrize(
    "kw", [{"seed": 2**63}, {"seed": -(2**63) - 1}, {"stop_token_ids": (2**31,)}, {"stop_token_ids": (-1,)}]
)
def test_sampling_beyond_the_wire_types_is_refused(kw):
    with pytest.raises(InvalidArgument):
        Sampling(max_tokens=4, **kw).validate()


def test_sampling_at_the_wire_bounds_encodes():
    s = Sampling(max_tokens=4, seed=2**63 - 1, stop_token_ids=(2**31 - 1,)).validate()
    assert s.to_proto().seed == 2**63 - 1


def test_a_prompt_that_leaves_no_room_is_refused_and_max_tokens_is_cut():
    limits = CallLimits(max_prompt_tokens=10_000, max_tokens_limit=1000, context_tokens=100, turn_tokens=80)
    with pytest.raises(InvalidArgument, match="context"):
        limits.fit(100, Sampling(max_tokens=1))
    with pytest.raises(InvalidArgument, match="trainable turn"):
        limits.fit(80, Sampling(max_tokens=1))
    assert limits.fit(70, Sampling(max_tokens=50)).max_tokens == 10
    assert limits.fit(10, Sampling(max_tokens=5)).max_tokens == 5
    with pytest.raises(InvalidArgument):
        limits.fit(0, Sampling(max_tokens=5))
    assert CallLimits(100, 100).fit(99, Sampling(max_tokens=100)).max_tokens == 100  # no limits set


def test_model_context_reads_the_model_config(tmp_path):
    assert model_context(str(tmp_path)) == 0
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert model_context(str(tmp_path)) == 8192


def test_the_turn_limit_is_never_off():
    assert turn_limit(2048, 32768) == 2048  # router.max_turn_tokens when set
    assert turn_limit(0, 32768) == 32768  # else the model's context
    assert turn_limit(0, 0) == DEFAULT_TURN_TOKENS  # else the packer's default budget
