"""The simulated cluster's parts below the mechanism: executions, groups and the per-version
ledger, and each cell with its engine (fluid decode, the KV capacity with admission, prefix
eviction and recompute preemption, as vLLM's block manager does). ``sim.cluster`` moves
executions between them; see its docstring for the model.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field

from gyre.etcd.values import CellState
from sim.cost import CostModel, DecodeRate
from sim.workload import Episode

CATEGORIES = ("decode", "prefill", "train", "weight_sync", "role_switch", "idle_rollout", "idle_train")
"""GPU-second categories; every cell-second falls in exactly one."""

EPS = 1e-9


Role = CellState
"""A cell's role lifecycle: the live system's :class:`CellState` (the simulator uses ROLLOUT,
DRAINING: moving to training, drained and switching, TRAINING, and RETURNING: switching back
to rollout)."""


class ExecState(enum.Enum):
    QUEUED = 0
    SANDBOX = 1
    GPU = 2  # prefill + decode of a turn
    TOOL = 3
    REWARD = 4
    CLOSED = 5


@dataclass(slots=True, eq=False)
class Group:
    """The executions of one task in one burst; ready when all have closed."""

    gid: int
    task: int
    burst: int
    version: int  # policy version it was dispatched with
    size: int
    closed: int = 0
    tokens: int = 0  # training tokens (final contexts of every member)
    work: float = 0.0  # their training work in 6N-equivalent tokens (CostModel.train_work_tokens)
    ready_s: float = -1.0
    # tokens generated under each policy version (for per-token lag)
    gen_by_version: dict[int, int] = field(default_factory=dict)
    members: list[Execution] = field(default_factory=list)
    consumed: bool = False  # assigned to a batch
    cancelled: bool = False  # unconsumable within the staleness bound (cancel early)
    length: int = 0  # generated tokens of its members at dispatch (for the length bias)
    dispatched_version: int = 0  # its first stamp (the partial rule restamps ``version``)


@dataclass(slots=True)
class VersionLedger:
    """The per-version ledger (services.scheduler.policy.VersionCounts, mutable)."""

    groups: int = 0
    dispatched: int = 0
    launched: int = 0
    finished: int = 0
    ready: int = 0
    consumed: int = 0
    cancelled: int = 0


@dataclass(slots=True, eq=False)
class Execution:
    xid: int
    group: Group
    ep: Episode
    state: ExecState = ExecState.QUEUED
    cell: Cell | None = None
    turn: int = 0
    ctx: int = 0  # tokens in context (prompts, observations, outputs so far)
    remaining: int = 0  # tokens still to generate in the current turn
    recompute: bool = False  # its KV is not on its current engine (after a reroute)
    fresh: int = 0  # tokens at the end of ctx that no engine has prefilled yet (this turn's prompt)
    waiting: bool = False  # in its engine's admission queue (KV capacity)
    dispatched_s: float = 0.0
    launched_s: float = -1.0
    closed_s: float = -1.0
    reroutes: int = 0
    cancelled: bool = False  # closed by the cancel-early rule, not by finishing
    # decode bookkeeping on the current engine
    start_v: float = 0.0
    ctx0: int = 0
    token: int = 0  # invalidates heap entries on removal


class Engine:
    """The inference engine of one cell: fluid decode with stalls for prefill and weight loads."""

    def __init__(self, cell: Cell, cost: CostModel) -> None:
        self.cell = cell
        self.cost = cost
        self.active: dict[int, Execution] = {}
        self.heap: list[tuple[float, int, int]] = []  # (finish_v, xid, token)
        self.v = 0.0
        self.a = 0.0  # sum(ctx0 - start_v) of active sequences
        self.t_last = 0.0
        self.stalls: deque[list] = deque()  # [category, remaining_s]
        self.stall_total = 0.0
        self.rate: DecodeRate | None = None
        self.rate_base = 0.0
        self.gen = 0
        self.version = 0
        self.tokens = 0
        # KV capacity (vLLM's block manager, in tokens): admission queue and prefix cache.
        self.cap = cost.kv_capacity_tokens
        self.bounded = self.cap != float("inf")
        self.admit_cap = self.cap * (1.0 - cost.cfg.kv_watermark)
        self.waiting: deque[Execution] = deque()  # arrived turns that do not fit yet
        self.cached: dict[int, int] = {}  # xid -> cached prefix tokens (insertion order: LRU first)
        self.cached_total = 0

    def running_tokens(self) -> float:
        """KV tokens of the running sequences (their contexts at the current V)."""
        return self.a + len(self.active) * self.v

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` context may be admitted now (an empty engine
        admits anything: a context longer than the KV still runs, alone)."""
        return not self.active or self.running_tokens() + tokens <= self.admit_cap

    def cache(self, ex: Execution) -> None:
        """``ex``'s prefilled context stays cached while it waits for its next turn."""
        n = ex.ctx - ex.fresh
        if self.bounded and n > 0:
            self.cached[ex.xid] = n
            self.cached_total += n

    def uncache(self, ex: Execution) -> bool:
        """Takes ``ex``'s cached prefix out (it runs again, or leaves): whether it was there."""
        n = self.cached.pop(ex.xid, None)
        if n is None:
            return False
        self.cached_total -= n
        return True

    def trim(self) -> int:
        """Evicts cached prefixes, least recently used first, until running and cached KV fit
        the capacity; returns how many were evicted."""
        over = self.running_tokens() + self.cached_total - self.cap
        evicted = 0
        cached = self.cached
        while over > 0 and cached:
            xid = next(iter(cached))
            n = cached.pop(xid)
            self.cached_total -= n
            over -= n
            evicted += 1
        return evicted

    def advance(self, t: float, acc: dict[str, float]) -> None:
        """Moves the engine's clock to t, charging the elapsed time to its categories."""
        dt = t - self.t_last
        if dt <= 0:
            return
        self.t_last = t
        stalls = self.stalls
        if stalls:
            while dt > EPS and stalls:
                s = stalls[0]
                take = min(dt, s[1])
                acc[s[0]] += take
                dt -= take
                s[1] -= take
                self.stall_total -= take
                if s[1] <= EPS:
                    stalls.popleft()
            if not stalls:
                self.stall_total = 0.0
        else:
            self.stall_total = 0.0
        if dt > 0:
            if self.active:
                rate = self.rate or self._rate()
                base = self.rate_base
                self.v = base + rate.advance(self.v - base, dt)
                acc["decode"] += dt
            else:
                acc["idle_rollout"] += dt

    def _rate(self) -> DecodeRate:
        """The decode rate of the current batch, with its origin at the current V (the
        total context is then a small positive number, never a difference of large ones)."""
        if self.rate is None:
            n = len(self.active)
            self.rate_base = self.v
            self.rate = self.cost.decode_rate(n, self.a + n * self.v)
        return self.rate

    def add_stall(self, category: str, seconds: float) -> None:
        if seconds > 0:
            self.stalls.append([category, seconds])
            self.stall_total += seconds

    def join(self, ex: Execution) -> None:
        ex.start_v = self.v
        ex.ctx0 = ex.ctx
        ex.token += 1
        self.active[ex.xid] = ex
        self.a += ex.ctx0 - ex.start_v
        heapq.heappush(self.heap, (self.v + ex.remaining, ex.xid, ex.token))
        self.rate = None

    def leave(self, ex: Execution) -> int:
        """Removes a decoding sequence; returns the tokens it generated here."""
        self.remove(ex)
        return int(min(ex.remaining, max(0.0, self.v - ex.start_v) + 1e-6))

    def remove(self, ex: Execution) -> None:
        """Removes a decoding sequence (its generated tokens are the caller's business)."""
        del self.active[ex.xid]
        ex.token += 1
        self.a -= ex.ctx0 - ex.start_v
        self.rate = None
        if not self.active:
            # Empty: restart the virtual clock at 0 so it never grows large.
            self.a = 0.0
            self.v = 0.0
            self.heap.clear()

    def next_finish_v(self) -> float | None:
        heap = self.heap
        while heap:
            fv, xid, tok = heap[0]
            ex = self.active.get(xid)
            if ex is not None and ex.token == tok:
                return fv
            heapq.heappop(heap)
        return None

    def take_finished(self) -> list[Execution]:
        """At a finish event: snaps V up to the earliest live finish (the float slack of the
        integration), then pops every sequence whose turn is done, in one pass over the heap."""
        heap = self.heap
        active = self.active
        pop = heapq.heappop
        while heap:
            fv, xid, tok = heap[0]
            ex = active.get(xid)
            if ex is not None and ex.token == tok:
                self.v = max(self.v, fv)
                break
            pop(heap)
        else:
            return []
        lim = self.v + 1e-6
        out = []
        while heap:
            fv, xid, tok = heap[0]
            ex = active.get(xid)
            if ex is None or ex.token != tok:
                pop(heap)
                continue
            if fv > lim:
                break
            pop(heap)
            out.append(ex)
        return out


class Cell:
    """One cell: an engine while in rollout, a trainer member while in training."""

    def __init__(self, cid: str, index: int, standalone: bool, slots: int, cost: CostModel) -> None:
        self.cid = cid
        self.index = index
        self.standalone = standalone
        self.slots = slots
        self.role = Role.ROLLOUT
        self.engine = Engine(self, cost)
        self.execs: dict[int, Execution] = {}  # executions whose route points here
        self.acc = {c: 0.0 for c in CATEGORIES}
        self.mode = "rollout"  # rollout (engine accounts) or one of CATEGORIES
        self.mode_since = 0.0
        self.gen = 0
        self.return_after_switch = False
        self.joined = False  # member of the training stream

    @property
    def free(self) -> int:
        return self.slots - len(self.execs) if self.role is Role.ROLLOUT else 0

    def account(self, t: float) -> None:
        """Charges time up to t."""
        if self.mode == "rollout":
            self.engine.advance(t, self.acc)
        else:
            dt = t - self.mode_since
            if dt > 0:
                self.acc[self.mode] += dt
        self.mode_since = t

    def set_mode(self, t: float, mode: str) -> None:
        self.account(t)
        if mode == "rollout":
            self.engine.t_last = t
        self.mode = mode
        self.mode_since = t
