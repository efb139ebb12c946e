"""Prefix communication groups over torch.distributed, formed at start-up and re-formed
after a failure without an operator, and the batch membership kept in the same rendezvous
store.

Every elastic cell is one rank (its elastic index). All of them rendezvous at the core's
TCPStore, form the default group (gloo on CPU, NCCL on CUDA) and create one subgroup for
every prefix [0..k-1], k = 2..world (``new_group`` is collective over the default group, so
it happens together, and the groups then stay alive across role changes). A batch's
participants always form a prefix, so its reduce and broadcast use the prefix's group.

Generations: each formation has an id the core writes to ``gyre/gen``; its groups
rendezvous under that prefix of the store, and the core marks it ``gyre/formed/<id>`` when
done. A failed collective (a peer died or hung past the timeout) is repaired by
:meth:`PrefixGroups.reform`: the core tears its groups down and starts a new generation;
satellites follow a new id when they see one (:meth:`PrefixGroups.wants_reform`), and a
satellite that finds its generation already formed (it was restarted) or whose collective
failed asks the core for one (``gyre/reform``, a counter). A restarted core starts a new
store and generation, to which satellites reconnect. Every formation waits for every rank,
so the groups come back once the dead cell is restarted (its supervisor's job).

Membership keys live in the store under ``gyre/<generation>/b<id>/``: ``v`` (the batch's
version), ``m`` ("open:<n>" then "closed:<n>", changed only by compare-and-set, so
registration and the core's freeze are atomic), ``k`` (the frozen size, for waiters). A new
generation starts them afresh: an attempt at a batch after a failure opens its window again.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from services.cell_agent.training.ports import JoinResult

log = logging.getLogger(__name__)


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def _forget_failed_init() -> None:
    """Puts torch's count of unnamed process groups back to 0 after an
    ``init_process_group`` that failed (a peer not up, or dead mid-formation).

    The default group rendezvouses under a name taken from that count, and each call takes
    the next one, failed or not; only destroying the default group sets it back, and a
    failed call leaves nothing to destroy. A cell that failed once then rendezvoused as
    group "1", "2", ... while a fresh peer waited under "0": they never met, and the prefix
    groups were not formed again until every cell restarted (the chaos demo's core,
    restarted while a satellite died, retried for good). torch has no public way to reset
    it (2.13: ``distributed_c10d._world.group_count``, reset in ``destroy_process_group``
    for the same reason: "to allow consistent value to be generated when we re-create
    process groups after some trainers recover from failure")."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


class PrefixGroups:
    """The process group of the elastic cells and one subgroup per prefix."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master: str,
        backend: str = "auto",
        device: torch.device | None = None,
        timeout_s: float = 600.0,
        form_timeout_s: float | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self.device = device or torch.device("cpu")
        self.backend = pick_backend(backend, self.device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.form_timeout = datetime.timedelta(seconds=min(form_timeout_s or timeout_s, timeout_s))
        """How long one formation waits for every rank (the rendezvous and gloo's or NCCL's
        connections): a formation its peers gave up for a new generation ends then, and the
        service builds again. The groups' collectives then get ``timeout``."""
        self.store: dist.Store | None = None
        self.groups: dict[int, Any] = {}  # prefix size -> torch.distributed ProcessGroup
        self.generation = ""
        self.formations = 0
        self._requests_seen = 0

    def setup(self) -> None:
        """Blocking rendezvous of every elastic cell (run it in a thread). One that fails
        (a peer not up, or dead mid-formation) lets go of its store: the core's next try
        listens on the same port."""
        try:
            self.store = self._connect()
            if self.rank == 0:
                self._new_generation()
            else:
                gen = self._current_generation()
                if self.world_size > 1 and self.store.check([f"gyre/formed/{gen}"]):
                    gen = self._ask_for_generation(gen)  # this cell was restarted: form anew
                self.generation = gen
            self._form()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> dist.Store:
        host, _, port = self.master.rpartition(":")
        return dist.TCPStore(
            host,
            int(port),
            self.world_size,
            is_master=self.rank == 0,
            timeout=self.timeout,
            wait_for_workers=False,
            use_libuv=True,
        )

    def _new_generation(self) -> None:
        assert self.store is not None
        self.generation = uuid.uuid4().hex[:12]
        self._requests_seen = int(self.store.add("gyre/reform", 0))
        self.store.set("gyre/gen", self.generation)

    def _current_generation(self) -> str:
        assert self.store is not None
        self.store.wait(["gyre/gen"])
        return self.store.get("gyre/gen").decode()

    def _ask_for_generation(self, old: str) -> str:
        """A satellite asks the core for a new generation; returns it once announced."""
        assert self.store is not None
        self.store.add("gyre/reform", 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (gen := self.store.get("gyre/gen").decode()) == old:
            if time.monotonic() > deadline:
                raise TimeoutError("the core announced no new generation of the prefix groups")
            time.sleep(0.1)
        return gen

    def _form(self) -> None:
        assert self.store is not None
        if self.world_size > 1:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"pg/{self.generation}", self.store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=self.form_timeout,
            )
            self.groups = {}
            for k in range(2, self.world_size + 1):
                self.groups[k] = dist.new_group(
                    list(range(k)), timeout=self.form_timeout, backend=self.backend
                )
            # Formed: collectives wait as long as a batch's peers may take (torch has no
            # public setter; 2.13's private one sets the backend's default timeout).
            mine = [g for k, g in self.groups.items() if self.rank < k]  # others: not a member
            for group in (None, *mine):
                dist.distributed_c10d._set_pg_timeout(self.timeout, group)
            if self.rank == 0:
                self.store.set(f"gyre/formed/{self.generation}", "1")
        self.formations += 1
        log.info(
            "prefix groups ready",
            extra={
                "rank": self.rank,
                "world": self.world_size,
                "backend": self.backend,
                "generation": self.generation,
                "formations": self.formations,
            },
        )

    def wants_reform(self) -> bool:
        """True when the groups must be formed again: (core) a satellite asked for it;
        (satellite) the core announced another generation, or its store is gone."""
        if self.world_size <= 1 or self.store is None:
            return False
        try:
            if self.rank == 0:
                return int(self.store.add("gyre/reform", 0)) > self._requests_seen
            return self.store.get("gyre/gen").decode() != self.generation
        except Exception:  # noqa: BLE001 (the core's store died with the core)
            return self.rank != 0

    def reform(self) -> None:
        """Tears the groups down and forms them again (blocking; run it in a thread, never
        while a collective is in flight). The core starts a new generation; a satellite
        reconnects to the core's store if it died, and asks for a new generation unless
        the core has announced one already."""
        old = self.generation
        self._destroy()
        if self.rank == 0:
            self._new_generation()
        else:
            try:
                gen = self.store.get("gyre/gen").decode() if self.store is not None else old
            except Exception:  # noqa: BLE001 (the core restarted: a new store)
                self.store = self._connect()
                gen = self._current_generation()
            if gen == old or (self.store is not None and self.store.check([f"gyre/formed/{gen}"])):
                gen = self._ask_for_generation(gen)
            self.generation = gen
        log.warning(
            "re-forming the prefix groups", extra={"rank": self.rank, "from": old, "to": self.generation}
        )
        self._form()

    def _destroy(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 (a broken group may fail to close cleanly)
                log.warning("destroying the broken process group failed", extra={"error": repr(exc)})
        elif self.world_size > 1:
            _forget_failed_init()
        self.groups = {}

    def close(self) -> None:
        self._destroy()
        self.store = None  # the core's store stops listening once nothing else holds it

    # Collective ----------------------------------------------------------------------

    def _group(self, k: int) -> Any:
        if k not in self.groups:
            raise ValueError(f"no prefix group of size {k} (world {self.world_size})")
        if self.rank >= k:
            raise ValueError(f"rank {self.rank} is not in the prefix of size {k}")
        return self.groups[k]

    def reduce_to_core(self, k: int, tensor: torch.Tensor, op: str = "sum") -> None:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.reduce(tensor, dst=0, op=reduce_op, group=self._group(k))

    def broadcast_from_core(self, k: int, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self._group(k))


class StoreMembership:
    """:class:`~services.cell_agent.training.ports.Membership` in the rendezvous store, under
    the groups' current generation."""

    def __init__(self, groups: PrefixGroups | dist.Store, poll_s: float = 0.01) -> None:
        self._groups = groups if isinstance(groups, PrefixGroups) else None
        self._store = None if isinstance(groups, PrefixGroups) else groups
        self.poll_s = poll_s

    @property
    def store(self) -> dist.Store:
        store = self._groups.store if self._groups is not None else self._store
        assert store is not None
        return store

    def _k(self, batch_id: int, name: str) -> str:
        gen = self._groups.generation if self._groups is not None else ""
        return f"gyre/{gen}/b{batch_id}/{name}" if gen else f"gyre/b{batch_id}/{name}"

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

    def members(self, batch_id: int) -> int:
        m = self._k(batch_id, "m")
        if not self.store.check([m]):
            return 0
        return int(self.store.get(m).decode().partition(":")[2])

    def wait_frozen(self, batch_id: int, timeout_s: float) -> int:
        key = self._k(batch_id, "k")
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} not frozen after {timeout_s}s")
            if self._groups is not None and self._groups.wants_reform():
                raise TimeoutError(f"batch {batch_id}: the prefix groups are being re-formed")
            time.sleep(self.poll_s)  # runs in a worker thread, never on the loop
        return int(self.store.get(key))
