"""Typed identifiers shared by every service (NewType: free at run time, checked by mypy)."""

from typing import NewType

CellId = NewType("CellId", str)
ExecutionId = NewType("ExecutionId", str)
GroupId = NewType("GroupId", str)
BurstId = NewType("BurstId", int)
BatchId = NewType("BatchId", int)
PolicyVersion = NewType("PolicyVersion", int)
Epoch = NewType("Epoch", int)
"""A scheduler leader's fencing epoch: the etcd create-revision of its leader key."""
RequestId = NewType("RequestId", str)
