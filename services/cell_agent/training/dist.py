"""Prefix communication groups over torch.distributed, created once at start-up, and the
batch membership kept in the same rendezvous store.

Every elastic cell is one rank (its elastic index). At start-up all of them rendezvous at
the core's TCPStore, form the default group (gloo on CPU, NCCL on CUDA) and create one
subgroup for every prefix [0..k-1], k = 2..world (``new_group`` is collective over the
default group, so it happens once, together, and the groups then stay alive across role
changes). A batch's participants always form a prefix, so its reduce and broadcast use the
prefix's group. Membership keys live in the store under ``gyre/b<id>/``: ``v`` (the
batch's version), ``m`` ("open:<n>" then "closed:<n>", changed only by compare-and-set, so
registration and the core's freeze are atomic), ``k`` (the frozen size, for waiters).
"""

from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.distributed as dist

from services.cell_agent.training.ports import JoinResult

log = logging.getLogger(__name__)


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


class PrefixGroups:
    """The process group of the elastic cells and one subgroup per prefix."""

    def __init__(self, rank: int, world_size: int, master: str, backend: str = "auto",
                 device: torch.device | None = None, timeout_s: float = 600.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self.device = device or torch.device("cpu")
        self.backend = pick_backend(backend, self.device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.Store | None = None
        self.groups: dict[int, object] = {}

    def setup(self) -> None:
        """Blocking rendezvous of every elastic cell (run it in a thread)."""
        host, _, port = self.master.rpartition(":")
        self.store = dist.TCPStore(
            host, int(port), self.world_size, is_master=self.rank == 0, timeout=self.timeout,
            wait_for_workers=False, use_libuv=True,
        )
        if self.world_size > 1:
            dist.init_process_group(
                self.backend, store=dist.PrefixStore("pg", self.store), rank=self.rank,
                world_size=self.world_size, timeout=self.timeout,
            )
            for k in range(2, self.world_size + 1):
                group = dist.new_group(list(range(k)), timeout=self.timeout, backend=self.backend)
                self.groups[k] = group
        log.info("prefix groups ready", extra={"rank": self.rank, "world": self.world_size, "backend": self.backend})

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.groups.clear()

    # Collective ----------------------------------------------------------------------

    def _group(self, k: int) -> object:
        if k not in self.groups:
            raise ValueError(f"no prefix group of size {k} (world {self.world_size})")
        if self.rank >= k:
            raise ValueError(f"rank {self.rank} is not in the prefix of size {k}")
        return self.groups[k]

    def reduce_to_core(self, k: int, tensor: torch.Tensor) -> None:
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM, group=self._group(k))

    def broadcast_from_core(self, k: int, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self._group(k))


class StoreMembership:
    """:class:`~services.cell_agent.training.ports.Membership` in the rendezvous store."""

    def __init__(self, store: dist.Store, poll_s: float = 0.01) -> None:
        self.store = store
        self.poll_s = poll_s

    @staticmethod
    def _k(batch_id: int, name: str) -> str:
        return f"gyre/b{batch_id}/{name}"

    def open(self, batch_id: int, version: int) -> None:
        # The version is written before the membership key exists: a satellite that sees
        # "open" always sees the version.
        self.store.set(self._k(batch_id, "v"), str(version))
        self.store.compare_set(self._k(batch_id, "m"), "", "open:1")

    def register(self, batch_id: int, index: int) -> tuple[JoinResult, int]:
        m = self._k(batch_id, "m")
        if not self.store.check([m]):
            return JoinResult.NOT_YET, -1
        version = int(self.store.get(self._k(batch_id, "v")))
        cur = self.store.compare_set(m, f"open:{index}", f"open:{index + 1}").decode()
        state, _, n = cur.partition(":")
        joined = int(n)
        if index < joined:
            return JoinResult.JOINED, version  # this call (or an earlier one of this cell)
        if state == "closed":
            return JoinResult.CLOSED, version
        return JoinResult.NOT_YET, version  # a predecessor has not joined yet

    def freeze(self, batch_id: int) -> int:
        m = self._k(batch_id, "m")
        while True:
            cur = self.store.get(m).decode()
            state, _, n = cur.partition(":")
            if state == "closed":
                return int(n)
            if self.store.compare_set(m, cur, f"closed:{n}").decode() == f"closed:{n}":
                self.store.set(self._k(batch_id, "k"), n)
                return int(n)

    def wait_frozen(self, batch_id: int, timeout_s: float) -> int:
        key = self._k(batch_id, "k")
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} not frozen after {timeout_s}s")
            time.sleep(self.poll_s)  # runs in a worker thread, never on the loop
        return int(self.store.get(key))
