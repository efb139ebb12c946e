"""The etcd values without a class of their own have one codec each in gyre.etcd.values:
a registration or leader key (where a process listens) and the published policy record.
Every reader gets the same answer from the same bytes, and an unreadable value is never
taken for a real one."""

from __future__ import annotations

import json

import pytest

from gyre.errors import InvalidArgument
from gyre.etcd.values import (
    decode_policy_record,
    encode_endpoint,
    encode_policy_record,
    endpoint_target,
    policy_version,
)


def test_an_endpoint_round_trips_with_its_extra_fields():
    raw = encode_endpoint("127.0.0.1:5", instance="s-1")
    assert json.loads(raw) == {"target": "127.0.0.1:5", "instance": "s-1"}
    assert endpoint_target(raw) == "127.0.0.1:5"
    assert endpoint_target(raw.decode()) == "127.0.0.1:5"


@pytest.mark.parametrize("raw", [None, b"", b"not json", b"[1]", b'{"pid": 3}', b"7"])
def test_an_unreadable_endpoint_has_no_target(raw):
    assert endpoint_target(raw) == ""


def test_a_policy_record_round_trips():
    raw = encode_policy_record(3, source_target="c:1", batch_id=7, training={"loss": 0.5})
    body = decode_policy_record(raw)
    assert body == {"version": 3, "source_target": "c:1", "batch_id": 7, "training": {"loss": 0.5}}
    assert policy_version(raw) == 3


@pytest.mark.parametrize(
    "raw",
    [b"x", b"[]", b"{}", b'{"version": -1}', b'{"version": "2"}', b'{"version": true}', b'{"version": 1.5}'],
)
def test_an_unreadable_policy_record_is_refused_and_has_no_version(raw):
    with pytest.raises(InvalidArgument, match="malformed policy record"):
        decode_policy_record(raw)
    assert policy_version(raw) is None


def test_no_policy_record_has_no_version():
    assert policy_version(None) is None
