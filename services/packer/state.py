"""The packer's state as a deterministic event-sourced machine: the trajectory buffer,
groups, batches, micro-steps and claims, changed only by :meth:`PackerState.apply`.

Every change is an event (a JSON-ready dict). The packer's parts (intake, packing, claims,
batches; composed in :mod:`services.packer.packer`) decide which events to apply
(validation, readiness rules, packing, claims) and the journal (:mod:`.journal`) writes
them to the WAL; replaying the WAL through ``apply`` rebuilds exactly this state. ``apply``
takes no decisions that depend on config, clock or policy version, so a replay cannot
diverge from the run that wrote it. Claim deadlines are runtime only (not replayed).

Conservation is counted in turns and checked by recounting the structures:
``produced = consumed + pending + ready + assigned + packed + sum(dropped)``. The unit packed
and trained is a trajectory segment (:mod:`services.packer.segments`): one or more turns of
an execution, fixed when its group is assigned to a batch (the ``assign`` event names them)
and referred to by its first turn.
"""

from __future__ import annotations

import collections
from typing import Any

from gyre.errors import FatalError
from gyre.execution import ExecutionStatus
from gyre.ids import BatchId, CellId, ExecutionId, GroupId
from services.packer.model import Finish, Turn
from services.packer.records import (
    Batch,
    Event,
    Execution,
    Group,
    GroupState,
    MicroStep,
    SeqRef,
)
from services.packer.segments import Segment, per_turn
from services.packer.snapshot import restore


class PackerState:
    """Everything the packer knows; see the module docstring."""

    def __init__(self) -> None:
        self.execs: dict[str, Execution] = {}
        self.groups: dict[str, Group] = {}
        self.ready: dict[str, None] = {}  # READY groups in readiness order (an ordered set)
        self.batches: dict[int, Batch] = {}
        self.filling: int = 0  # the batch receiving groups
        self.micro_steps: dict[str, MicroStep] = {}
        self.held: dict[str, MicroStep] = {}  # claimed, not acknowledged
        self.seen_turns: dict[SeqRef, int] = {}  # -> content digest (idempotency)
        self.finished: dict[str, Finish] = {}
        self.resolved: set[str] = set()  # groups dropped or trained (their data is freed)
        # Resolved groups whose idempotency records are still kept, in resolution order:
        # group -> (the batch being filled then, {execution: its turn indexes}).
        self.forgettable: dict[str, tuple[int, dict[str, list[int]]]] = {}
        self.produced = 0
        self.consumed = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.groups_dropped: collections.Counter[str] = collections.Counter()
        self.groups_filtered = 0
        """Groups dropped that the scheduler did not cancel (no member closed CANCELLED): zero
        variance, failed members, stale, ... The scheduler's dispatch gate lets them go, as it
        does its own cancelled groups, so that they are replaced (from the WAL: survives
        restarts)."""
        self.claims_expired = 0
        self.tokens_trained = 0
        """Packed tokens of acknowledged micro-steps (since this process started)."""
        self.groups_ready_total = 0
        """Groups that became ready (since this process started)."""
        self.policy_version = 0
        self.events_applied = 0
        self.wal_id = ""

    # Queries -----------------------------------------------------------------------------

    def turn(self, ref: SeqRef) -> Turn:
        return self.execs[ref[0]].turns[ref[1]]

    def segment(self, ref: SeqRef) -> Segment:
        """The segment that starts at turn ``ref`` (assigned groups only)."""
        ex = self.execs[ref[0]]
        return Segment(tuple(ex.turns[i] for i in ex.segments[ref[1]]))

    def segment_tokens(self, ref: SeqRef) -> int:
        """``segment(ref).tokens`` without building the segment (packing asks for every one)."""
        ex = self.execs[ref[0]]
        last = ex.turns[ex.segments[ref[1]][-1]]
        return len(last.prompt) + len(last.output)

    def segment_turns(self, ref: SeqRef) -> int:
        return len(self.execs[ref[0]].segments[ref[1]])

    def current_batch(self) -> Batch:
        """The oldest batch still open to joiners (not closed): what ``batch_id`` 0 means.
        The batch being filled is never closed, so there always is one."""
        return self.batches[min(b for b, batch in self.batches.items() if not batch.closed)]

    def stamp(self, group: Group) -> int:
        """The policy version a group serves: the newest its members' finish reports carry
        (one version under the cancel rule; under the partial rule the members that closed
        after the scheduler restamped the group carry the newer one)."""
        return max(
            (ex.finish.policy_version for ex in group.execs.values() if ex.finish is not None), default=0
        )

    def optimizing(self) -> bool:
        """True while the optimizer step of a trained batch runs: every micro-step of it is
        acknowledged and the version it trained on is still the newest published."""
        done = [b for b in self.batches.values() if b.done and b.version is not None]
        return bool(done) and max(done, key=lambda b: b.id).version >= self.policy_version  # type: ignore[operator]

    def buffered(self) -> dict[str, int]:
        """Turns held, by where they are, recounted from the structures."""
        pending = ready = 0
        for g in self.groups.values():
            if g.state is GroupState.COLLECTING:
                pending += g.turns
            elif g.state is GroupState.READY:
                ready += g.turns
        assigned = sum(self.segment_turns(r) for b in self.batches.values() for r in b.pending)
        packed = sum(b.packed_seqs for b in self.batches.values())
        return {"pending": pending, "ready": ready, "assigned": assigned, "packed": packed}

    def counters(self) -> dict[str, Any]:
        held = self.buffered()
        return {
            "produced": self.produced,
            "consumed": self.consumed,
            "buffered": sum(held.values()),
            "dropped": dict(self.dropped),
            **held,
            "claims_expired": self.claims_expired,
            "policy_version": self.policy_version,
        }

    def check(self, deep: bool = False) -> None:
        """Conservation and structural invariants; a violation is a bug (FatalError).
        ``deep`` also proves no turn sits in two live micro-steps (O(live turns))."""
        held = sum(self.buffered().values())
        dropped = sum(self.dropped.values())
        if self.produced != self.consumed + held + dropped:
            raise FatalError(
                f"conservation broken: produced {self.produced} != consumed {self.consumed} "
                f"+ buffered {held} + dropped {dropped}"
            )
        for b in self.batches.values():
            if len(b.groups) > b.size:
                raise FatalError(f"batch {b.id} holds {len(b.groups)} groups > {b.size}")
            if b.closed and not b.sealed:
                raise FatalError(f"batch {b.id} closed before sealed")
        if not deep:
            return
        seen: set[SeqRef] = set()
        for m in self.micro_steps.values():
            if m.acked_by is not None:
                continue
            if (m.holder is None) != (m.id in self.batches[m.batch_id].free):
                raise FatalError(f"micro-step {m.id}: free list out of step")
            for ref in m.seqs:
                if ref in seen:
                    raise FatalError(f"turn {ref} packed twice")
                seen.add(ref)

    # The one mutator ---------------------------------------------------------------------

    def apply(self, ev: Event) -> None:
        """Applies one event. Events come from the controller or a WAL replay."""
        handler = getattr(self, "_on_" + ev["t"], None)
        if handler is None:
            raise FatalError(f"unknown packer event {ev['t']!r}")
        handler(ev)
        self.events_applied += 1

    def _exec(self, execution_id: str, group_id: str) -> Execution:
        ex = self.execs.get(execution_id)
        if ex is None:
            ex = self.execs[execution_id] = Execution(ExecutionId(execution_id), GroupId(group_id))
            group = self.groups.get(group_id)
            if group is None:
                group = self.groups[group_id] = Group(GroupId(group_id))
            group.execs[execution_id] = ex
        return ex

    def _on_turn(self, ev: Event) -> None:
        turn = Turn.from_json(ev["turn"])
        ex = self._exec(turn.execution_id, turn.group_id)
        if turn.turn_index not in ex.turns:
            self.produced += 1
        # else: a retried call's answer replacing its first try's (same idempotency key)
        ex.turns[turn.turn_index] = turn
        if turn.call_key:
            ex.call_keys[turn.call_key] = turn.turn_index
        self.seen_turns[turn.key] = turn.digest()

    def _on_finish(self, ev: Event) -> None:
        finish = Finish.from_json(ev["finish"])
        ex = self._exec(finish.execution_id, finish.group_id)
        ex.finish = finish
        self.groups[finish.group_id].size = finish.group_size
        self.finished[finish.execution_id] = finish

    def _on_ready(self, ev: Event) -> None:
        group = self.groups[ev["g"]]
        for x, reason in ev.get("drop_x", {}).items():
            ex = group.execs.pop(x)
            self.dropped[reason] += len(ex.turns)
            self.execs.pop(x, None)
            group.gone[x] = sorted(ex.turns)
        group.advantages = {k: float(v) for k, v in ev["adv"].items()}
        group.oldest_version = int(ev["oldest"])
        group.transition(GroupState.READY)
        self.ready[group.id] = None
        self.groups_ready_total += 1

    def _on_drop(self, ev: Event) -> None:
        group = self.groups[ev["g"]]
        group.transition(GroupState.DROPPED)
        self.dropped[ev["reason"]] += group.turns
        self.groups_dropped[ev["reason"]] += 1
        if not self._cancelled_by_scheduler(group):
            self.groups_filtered += 1
        self.ready.pop(group.id, None)
        self._free_group(group)

    def _cancelled_by_scheduler(self, group: Group) -> bool:
        """A member of ``group`` closed CANCELLED: the scheduler cancelled the group (cancel
        early cancels every open member) and counts it itself."""
        members = [*group.execs, *group.gone]
        return any(
            (f := self.finished.get(x)) is not None and f.status is ExecutionStatus.CANCELLED for x in members
        )

    def _free_group(self, group: Group) -> None:
        members = {x: sorted(e.turns) for x, e in group.execs.items()} | group.gone
        for x in group.execs:
            self.execs.pop(x, None)
        self.groups.pop(group.id, None)
        self.resolved.add(group.id)
        self.forgettable[group.id] = (self.filling, members)

    def _on_forget(self, ev: Event) -> None:
        # Idempotency records of long-resolved groups: a retry this late is refused instead.
        for gid in ev["groups"]:
            _, members = self.forgettable.pop(gid)
            for x, turns in members.items():
                self.finished.pop(x, None)
                for i in turns:
                    self.seen_turns.pop((x, i), None)

    def _on_batch(self, ev: Event) -> None:
        b = int(ev["b"])
        if b in self.batches:
            raise FatalError(f"batch {b} created twice")
        self.batches[b] = Batch(BatchId(b), int(ev["size"]))
        self.filling = b

    def _on_activate(self, ev: Event) -> None:
        batch = self.batches[int(ev["b"])]
        if batch.version is not None:
            raise FatalError(f"batch {batch.id} activated twice")
        batch.version = int(ev["v"])

    def _on_assign(self, ev: Event) -> None:
        batch = self.batches[int(ev["b"])]
        group = self.groups[ev["g"]]
        segs = ev.get("segs")  # absent in WALs written before segments: a turn each
        splits: dict[str, list[tuple[int, ...]]] = {}
        for x in sorted(group.execs):  # checked in full before anything changes
            ex = group.execs[x]
            split = (
                [tuple(int(i) for i in s) for s in segs[x]] if segs is not None else per_turn(list(ex.turns))
            )
            if sorted(i for s in split for i in s) != sorted(ex.turns):
                raise FatalError(f"assign {group.id}: segments of {x} do not cover its turns")
            splits[x] = split
        group.transition(GroupState.ASSIGNED)
        group.batch_id = batch.id
        self.ready.pop(group.id, None)
        batch.groups.append(group.id)
        for x, split in splits.items():
            group.execs[x].segments = {s[0]: s for s in split}
            for s in split:
                batch.pending[(x, s[0])] = None

    def _on_emit(self, ev: Event) -> None:
        batch = self.batches[int(ev["b"])]
        refs = [(str(x), int(i)) for x, i in ev["seqs"]]
        taken = set(refs)
        if len(taken) != len(refs) or not all(r in batch.pending for r in refs):
            raise FatalError(f"emit {ev['ms']}: sequences not pending in batch {batch.id}")
        for r in refs:
            del batch.pending[r]
        n_seqs = loss_tokens = packed_tokens = 0
        for x, i in refs:  # what the segments (Segment) would sum, without building them
            ex = self.execs[x]
            indexes = ex.segments[i]
            n_seqs += len(indexes)
            for k in indexes:
                loss_tokens += ex.turns[k].loss_tokens
            last = ex.turns[indexes[-1]]
            packed_tokens += len(last.prompt) + len(last.output)
        ms = MicroStep(
            id=ev["ms"],
            batch_id=batch.id,
            index=len(batch.micro_steps),
            seqs=refs,
            n_seqs=n_seqs,
            loss_tokens=loss_tokens,
            packed_tokens=packed_tokens,
        )
        batch.micro_steps.append(ms)
        batch.free[ms.id] = None
        batch.packed_seqs += ms.n_seqs
        batch.total_loss_tokens += ms.loss_tokens
        self.micro_steps[ms.id] = ms

    def _on_seal(self, ev: Event) -> None:
        batch = self.batches[int(ev["b"])]
        if batch.pending:
            raise FatalError(f"batch {batch.id} sealed with unpacked sequences")
        batch.sealed = True
        self._maybe_close(batch)

    def _on_claim(self, ev: Event) -> None:
        ms = self.micro_steps[ev["ms"]]
        if not ms.free:
            raise FatalError(f"micro-step {ms.id} claimed while held or acked")
        ms.holder = CellId(ev["cell"])
        ms.released_from = None
        self.held[ms.id] = ms
        batch = self.batches[ms.batch_id]
        del batch.free[ms.id]
        if ev.get("key"):
            batch.claim_keys[(ms.holder, str(ev["key"]))] = ms.id
        batch.participants.add(ms.holder)
        self._maybe_close(batch)

    def _on_release(self, ev: Event) -> None:
        ms = self.micro_steps[ev["ms"]]
        ms.released_from, ms.holder = ms.holder, None
        del self.held[ms.id]
        self.batches[ms.batch_id].free[ms.id] = None
        if ev.get("expired", True):
            self.claims_expired += 1

    def _on_ack(self, ev: Event) -> None:
        ms = self.micro_steps[ev["ms"]]
        if ms.acked_by is not None:
            raise FatalError(f"micro-step {ms.id} acknowledged twice")
        ms.acked_by = CellId(ev["cell"])
        ms.holder = None
        self.held.pop(ms.id, None)
        batch = self.batches[ms.batch_id]
        batch.free.pop(ms.id, None)  # a late ack of a returned, untaken micro-step
        batch.participants.add(ms.acked_by)
        batch.acked += 1
        if not batch.leased:  # final at once; a leased batch's acks wait for its commit
            self._consume(batch, ms)
        self._maybe_close(batch)
        if batch.sealed and batch.acked == len(batch.micro_steps):
            if batch.leased:
                batch.done = True  # every gradient is computed: the core may step
            else:
                self._finish_batch(batch)

    def _consume(self, batch: Batch, ms: MicroStep) -> None:
        ms.committed = True
        self.consumed += ms.n_seqs
        self.tokens_trained += ms.packed_tokens
        batch.packed_seqs -= ms.n_seqs

    def _on_open(self, ev: Event) -> None:
        """The core opens an attempt: what an earlier attempt held or acked returns."""
        batch = self.batches[int(ev["b"])]
        if batch.committed:
            raise FatalError(f"batch {batch.id} opened after its commit")
        for ms in batch.micro_steps:
            if ms.committed:
                continue
            if ms.acked_by is not None:
                ms.acked_by = None
                batch.acked -= 1
            if ms.holder is not None:
                self.held.pop(ms.id, None)
                ms.holder = None
            ms.released_from = None
        batch.free = {ms.id: None for ms in batch.micro_steps if not ms.committed}
        batch.participants.clear()
        batch.claim_keys.clear()
        batch.closed = batch.done = False
        batch.attempt += 1
        self._maybe_close(batch)

    def _on_commit(self, ev: Event) -> None:
        batch = self.batches[int(ev["b"])]
        if batch.acked != len(batch.micro_steps) or not batch.sealed:
            raise FatalError(f"batch {batch.id} committed before every micro-step was acknowledged")
        for ms in batch.micro_steps:
            if not ms.committed:
                self._consume(batch, ms)
        self._finish_batch(batch)

    def _on_snapshot(self, ev: Event) -> None:
        restore(self, ev)

    def _on_wal(self, ev: Event) -> None:
        self.wal_id = str(ev["id"])  # the log's header: its incarnation id

    def _on_policy(self, ev: Event) -> None:
        self.policy_version = max(self.policy_version, int(ev["v"]))

    def _maybe_close(self, batch: Batch) -> None:
        if batch.sealed and not batch.closed and not batch.free:
            batch.closed = True

    def _finish_batch(self, batch: Batch) -> None:
        # Trained: free the tokens; ids stay for idempotent answers.
        batch.done = batch.committed = True
        batch.claim_keys.clear()
        for m in batch.micro_steps:
            m.seqs = []
        for gid in batch.groups:
            group = self.groups.get(gid)
            if group is not None:
                group.transition(GroupState.DONE)
                self._free_group(group)
