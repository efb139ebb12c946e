"""The packer's intake: turns (routers) and finish reports (the scheduler) joined per
execution, and readiness. A group whose executions have all closed waits out its grace
period (``ready_grace_s``; after a restart, ``restart_grace_s`` too), then becomes ready
with its group-relative advantages or is dropped with its reason; a ready group that goes
stale, or that no batch within eta can take, before a batch took it is dropped too. Also
where an execution's token sequence stands (GetTrajectory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from gyre.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from gyre.failpoints import failpoint
from gyre.ids import check_idempotency_key
from gyre.staleness import PARTIAL, unconsumable
from services.packer.advantages import group_advantages, is_stale, reward_std
from services.packer.config import PackerConfig
from services.packer.journal import Journal
from services.packer.model import Finish, Turn, check_id
from services.packer.packing import Packing
from services.packer.records import Group, GroupState

log = logging.getLogger(__name__)

LATE_TURN = "came after its finish report and its group's readiness"
"""The end of the message refusing a turn whose group was complete (the history checker reads
it in the router's ``turn_refused`` operations: a late turn of a group that trained is lost)."""


class Intake:
    """Buffers turns and finish reports; decides when a group is ready, and what it trains."""

    def __init__(
        self, *, cfg: PackerConfig, clock: Callable[[], float], journal: Journal, packing: Packing
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.journal = journal
        self.state = journal.state
        self.packing = packing
        self._complete: dict[str, float] = {}  # all closed, in the grace period -> since
        self._ready_floor = float("-inf")  # no group becomes ready before (restart_grace_s)
        self._scanned: tuple[int, bool, int, str | None] | None = None  # see drop_unusable
        self.turns_replaced = 0  # a retried model call's answer over its first try's (runtime count)
        self.late_turns = 0  # refused: their group was already ready (runtime count)

    def recovered(self, now: float, restart: bool) -> None:
        """After a replay: the grace period of every complete group restarts at ``now``."""
        for group in self.state.groups.values():
            if group.state is GroupState.COLLECTING and group.size and group.closed >= group.size:
                self._complete[group.id] = now
        if restart:
            # A restart: the routers may hold turns queued while we were down, whose groups'
            # finish reports the scheduler may relay first; they get in before any group is
            # made ready (a later turn would be refused, and lost).
            self._ready_floor = now + self.cfg.restart_grace_s

    @property
    def in_grace(self) -> bool:
        """Some group has all its executions closed and waits out its grace period."""
        return bool(self._complete)

    # Commands ----------------------------------------------------------------------------

    async def record_turn(self, turn: Turn) -> bool:
        """Buffers one turn; True when it had been recorded before (idempotent).

        A turn whose idempotency key its execution already holds is a retry of that model
        call (sent again after its router died): it takes the first try's index; with the
        same content it is a duplicate, with other content it replaces the first try (the
        harness got only the retry's answer, and its next prompt continues that one)."""
        st = self.state
        replaces = False
        ex = st.execs.get(turn.execution_id) if turn.call_key else None
        if ex is not None and turn.call_key in ex.call_keys:
            first = ex.turns[ex.call_keys[turn.call_key]]
            if first.prompt != turn.prompt:
                raise FailedPrecondition(
                    f"idempotency key {turn.call_key!r} of {turn.execution_id} was recorded for "
                    f"another prompt (turn {first.turn_index})"
                )
            turn = dataclasses.replace(turn, turn_index=first.turn_index)
            replaces = st.seen_turns.get(turn.key) != turn.digest()
        digest = st.seen_turns.get(turn.key)
        if replaces:
            digest = None  # recorded below, over the first try
        if digest is not None:
            if digest != turn.digest():
                raise FailedPrecondition(
                    f"turn {turn.turn_index} of {turn.execution_id} was recorded with other content"
                )
            await self.journal.sync()
            return True
        self._check_open(turn, replaces)
        if replaces:
            self.turns_replaced += 1
            log.info(
                "a retried model call replaced its first try's turn",
                extra={"execution_id": turn.execution_id, "turn_index": turn.turn_index},
            )
        self.journal.commit({"t": "turn", "turn": turn.to_json()})
        self.journal.after()
        await self.journal.sync()
        failpoint("packer.turn.durable")  # the turn in the WAL, the router not yet answered
        return False

    def _check_open(self, turn: Turn, replaces: bool) -> None:
        """Raises unless a new turn may join its group: still collecting, and room for it."""
        st = self.state
        self._check_membership(turn.execution_id, turn.group_id)
        group = st.groups.get(turn.group_id)
        if turn.group_id in st.resolved or (group is not None and group.state is not GroupState.COLLECTING):
            self.late_turns += 1
            raise FailedPrecondition(
                f"group {turn.group_id} is already complete; turn {turn.turn_index} of "
                f"{turn.execution_id} {LATE_TURN}"
            )
        if not replaces and self._held() >= self.cfg.max_buffered_turns:
            raise ResourceExhausted(f"the packer holds {self._held()} turns (max_buffered_turns)")

    async def report_finish(self, finish: Finish) -> bool:
        """Closes an execution; True when it had been reported before (idempotent)."""
        st = self.state
        prev = st.finished.get(finish.execution_id)
        if prev is not None:
            if prev != finish:
                raise FailedPrecondition(
                    f"execution {finish.execution_id} was reported finished with other content"
                )
            await self.journal.sync()
            # The first report's history line may be what a crash took: say it arrived.
            self.journal.note("finish_again", execution_id=finish.execution_id, group_id=finish.group_id)
            return True
        self._check_membership(finish.execution_id, finish.group_id)
        if finish.group_id in st.resolved:
            raise FailedPrecondition(f"group {finish.group_id} is already complete")
        group = st.groups.get(finish.group_id)
        if group is not None:
            if group.size and group.size != finish.group_size:
                raise InvalidArgument(
                    f"group {finish.group_id} has group_size {group.size}, not {finish.group_size}"
                )
            if group.state is not GroupState.COLLECTING or group.closed >= finish.group_size:
                raise FailedPrecondition(
                    f"group {finish.group_id} already has its {group.size} closed executions"
                )
        self.journal.commit({"t": "finish", "finish": finish.to_json()})
        group = st.groups[finish.group_id]
        if group.closed >= group.size:
            self._complete[group.id] = self.clock()
        self.journal.after()
        await self.journal.sync()
        failpoint("packer.finish.durable")  # the finish in the WAL, the scheduler not yet answered
        return False

    async def observe_policy(self, version: int) -> None:
        """A newer policy version (from etcd): stale ready groups are dropped."""
        if version > self.state.policy_version:
            self.journal.commit({"t": "policy", "v": version})
            self.journal.after()
            await self.journal.sync()

    # Queries -----------------------------------------------------------------------------

    def trajectory(self, execution_id: str, call_key: str = "") -> tuple[Turn | None, int]:
        """Where an execution's token sequence stands (GetTrajectory): the turn a new model
        call of it continues (None: there is none) and the index that call's turn takes. A
        call whose idempotency key the execution holds is a retry of that call: it continues
        the turn before its first try's, and takes the first try's index."""
        check_id(execution_id, "execution_id")
        if call_key:
            check_idempotency_key(call_key)
        ex = self.state.execs.get(execution_id)
        if ex is None or not ex.turns:
            return None, 0
        index = ex.call_keys.get(call_key) if call_key else None
        if index is None:
            index = max(ex.turns) + 1
        before = [i for i in ex.turns if i < index]
        return (ex.turns[max(before)] if before else None), index

    # Decisions (the pump's first steps) --------------------------------------------------

    def resolve_due(self) -> None:
        """Groups whose grace period has passed (and the restart's, if any) are resolved."""
        now = self.clock()
        for gid, since in list(self._complete.items()) if now >= self._ready_floor else ():
            if now - since >= self.cfg.ready_grace_s:
                del self._complete[gid]
                self._resolve(self.state.groups[gid])

    def drop_unusable(self, full: bool) -> None:
        """Drops the ready groups that went stale, or that no batch within eta can take
        (``full``: the batch being filled is full, or the optimizer steps)."""
        st, cfg = self.state, self.cfg
        # Whether a ready group is stale or unconsumable depends only on its own versions
        # (fixed once it is ready) and on (policy version, batch full): scan again only when
        # those changed or a group became ready since (it joins st.ready at the end). The
        # scan was O(ready groups x members) on every claim and change.
        for gid in list(st.ready) if self._scan_key(full) != self._scanned else ():
            group = st.groups[gid]
            if is_stale(self._age_of(group, group.oldest_version), st.policy_version, cfg.max_staleness):
                self._drop(group, "stale")
            elif unconsumable(st.stamp(group), st.policy_version, full, cfg.max_staleness):
                # The scheduler's cancel-early rule (gyre.staleness): no batch within eta can
                # take it; its open members are being cancelled, its ready copy goes too.
                self._drop(group, "unconsumable")
        self._scanned = self._scan_key(full)

    def _resolve(self, group: Group) -> None:
        """A group whose executions have all closed becomes ready, or is dropped (and why)."""
        if group.state is not GroupState.COLLECTING or not group.size or group.closed < group.size:
            return
        cfg = self.cfg
        members = {x: e for x, e in group.execs.items() if e.finish is not None}
        drop_x = {x: "unfinished" for x, e in group.execs.items() if e.finish is None}
        failed = [x for x, e in members.items() if e.finish is not None and not e.finish.status.ok]
        if failed:
            if cfg.failed_member_rule == "drop_group":
                return self._drop(group, "failed_group")
            drop_x.update({x: "failed_execution" for x in failed})
            if len(members) - len(failed) < cfg.min_group_members:
                return self._drop(group, "failed_group")
        kept = {x: e for x, e in members.items() if x not in drop_x}
        if not any(e.turns for e in kept.values()):
            return self._drop(group, "empty")
        rewards = {x: e.finish.reward for x, e in kept.items() if e.finish is not None}
        if any(abs(r) > cfg.max_abs_reward for r in rewards.values()):
            # Only a WAL written before rewards were bounded holds these: their statistics
            # overflow, so the group goes and the packer stays up (no crash loop on replay).
            return self._drop(group, "invalid_reward")
        if cfg.drop_zero_variance and reward_std(list(rewards.values())) <= cfg.zero_variance_tol:
            return self._drop(group, "zero_variance")
        oldest = min(
            t.oldest_version(e.finish.policy_version)
            for e in kept.values()
            if e.finish is not None
            for t in e.turns.values()
        )
        if is_stale(self._age_of(group, oldest), self.state.policy_version, cfg.max_staleness):
            return self._drop(group, "stale")
        adv = group_advantages(rewards, cfg.advantage_std_normalize, cfg.advantage_eps)
        if not all(math.isfinite(a) for a in adv.values()):
            return self._drop(group, "invalid_reward")  # never with bounded rewards; a last guard
        self.journal.commit({"t": "ready", "g": group.id, "adv": adv, "oldest": oldest, "drop_x": drop_x})
        self.packing.pre_encode(adv)

    def _drop(self, group: Group, reason: str) -> None:
        log.info("group dropped", extra={"group_id": group.id, "reason": reason, "turns": group.turns})
        self.journal.commit({"t": "drop", "g": group.id, "reason": reason})

    def _age_of(self, group: Group, oldest: int) -> int:
        """The version staleness is judged by: the oldest token's (cancel rule), or the
        group's stamp (partial rule: a restamped group keeps its older tokens)."""
        return self.state.stamp(group) if self.cfg.stale_rule == PARTIAL else oldest

    def _scan_key(self, full: bool) -> tuple[int, bool, int, str | None]:
        """What the ready groups' staleness depends on besides their own versions: the policy
        version, the filling batch's fullness, and the ready set (new groups join at its end)."""
        st = self.state
        return st.policy_version, full, len(st.ready), next(reversed(st.ready), None)

    def _check_membership(self, execution_id: str, group_id: str) -> None:
        st = self.state
        known = st.execs.get(execution_id)
        owner = known.group_id if known is not None else None
        if owner is None and execution_id in st.finished:
            owner = st.finished[execution_id].group_id
        if owner is not None and owner != group_id:
            raise InvalidArgument(f"execution {execution_id} belongs to group {owner}, not {group_id}")

    def _held(self) -> int:
        st = self.state
        return st.produced - st.consumed - sum(st.dropped.values())
