"""Typed identifiers (NewType: free at run time, checked by mypy wherever they are used).

Today the packer, the election and fencing use them; the scheduler, router and cell agent still
pass plain ``str``/``int`` ids (mypy cannot check what is not annotated with these)."""

from typing import NewType

CellId = NewType("CellId", str)
ExecutionId = NewType("ExecutionId", str)
GroupId = NewType("GroupId", str)
BatchId = NewType("BatchId", int)
PolicyVersion = NewType("PolicyVersion", int)
Epoch = NewType("Epoch", int)
"""A scheduler leader's fencing epoch: the etcd create-revision of its leader key."""
