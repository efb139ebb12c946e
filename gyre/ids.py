"""Typed identifiers (NewType: free at run time, checked by mypy wherever they are used).

Today the packer, the election and fencing use them; the scheduler, router and cell agent still
pass plain ``str``/``int`` ids (mypy cannot check what is not annotated with these)."""

from typing import NewType

from gyre.errors import InvalidArgument

CellId = NewType("CellId", str)
ExecutionId = NewType("ExecutionId", str)
GroupId = NewType("GroupId", str)
BatchId = NewType("BatchId", int)
PolicyVersion = NewType("PolicyVersion", int)
Epoch = NewType("Epoch", int)
"""A scheduler leader's fencing epoch: the etcd create-revision of its leader key."""

MAX_IDEMPOTENCY_KEY_CHARS = 128


def check_idempotency_key(value: str) -> str:
    """A model call's idempotency key (router GenerateRequest.idempotency_key, the HTTP
    ``Idempotency-Key`` header, packer TurnRecord.idempotency_key): empty (none), or 1..128
    printable ASCII characters. Raises InvalidArgument."""
    if len(value) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise InvalidArgument(f"idempotency key longer than {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    if any(not 0x21 <= ord(c) <= 0x7E for c in value):
        raise InvalidArgument("idempotency key must be printable ASCII without spaces")
    return value
