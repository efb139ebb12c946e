"""Checkpoints of the packer's state: the whole :class:`PackerState` as one JSON-ready
``snapshot`` event, so that the WAL can be compacted to ``[header, snapshot]`` and replay
stays proportional to what is buffered, not to everything ever recorded."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from gyre.ids import BatchId, CellId, ExecutionId, GroupId
from services.packer.model import Finish, Turn
from services.packer.records import Batch, Event, Execution, Group, GroupState, MicroStep

if TYPE_CHECKING:
    from services.packer.state import PackerState


def to_event(st: PackerState) -> Event:
    """The state as a ``snapshot`` event (claim deadlines are runtime and not included).
    The event shares nothing mutable with the state, so it can be encoded off the loop."""
    groups = {}
    for gid, g in st.groups.items():
        groups[gid] = {
            "size": g.size,
            "state": g.state.value,
            "batch_id": g.batch_id,
            "adv": dict(g.advantages),
            "oldest": g.oldest_version,
            "gone": {x: list(t) for x, t in g.gone.items()},
            "execs": {
                x: {
                    "turns": [t.to_json() for _, t in sorted(e.turns.items())],
                    "finish": e.finish.to_json() if e.finish is not None else None,
                    "segs": [list(s) for _, s in sorted(e.segments.items())],
                }
                for x, e in g.execs.items()
            },
        }
    batches = {}
    for b, bt in st.batches.items():
        batches[str(b)] = {
            "size": bt.size,
            "version": bt.version,
            "groups": list(bt.groups),
            "pending": [list(r) for r in bt.pending],
            "free": list(bt.free),
            "participants": sorted(bt.participants),
            "sealed": bt.sealed,
            "closed": bt.closed,
            "done": bt.done,
            "total": bt.total_loss_tokens,
            "acked": bt.acked,
            "packed_seqs": bt.packed_seqs,
            "attempt": bt.attempt,
            "committed": bt.committed,
            "claim_keys": [[c, k, m] for (c, k), m in bt.claim_keys.items()],
            "micro_steps": [
                {
                    "id": m.id,
                    "index": m.index,
                    "seqs": [list(r) for r in m.seqs],
                    "n": m.n_seqs,
                    "loss": m.loss_tokens,
                    "packed": m.packed_tokens,
                    "holder": m.holder,
                    "acked_by": m.acked_by,
                    "released_from": m.released_from,
                    "committed": m.committed,
                }
                for m in bt.micro_steps
            ],
        }
    return {
        "t": "snapshot",
        "groups": groups,
        "ready": list(st.ready),
        "batches": batches,
        "filling": st.filling,
        "seen_turns": [[x, i, d] for (x, i), d in st.seen_turns.items()],
        "finished": {x: f.to_json() for x, f in st.finished.items()},
        "resolved": sorted(st.resolved),
        "forgettable": [
            [gid, b, {x: list(t) for x, t in m.items()}] for gid, (b, m) in st.forgettable.items()
        ],
        "produced": st.produced,
        "consumed": st.consumed,
        "dropped": dict(st.dropped),
        "groups_dropped": dict(st.groups_dropped),
        "groups_filtered": st.groups_filtered,
        "claims_expired": st.claims_expired,
        "policy_version": st.policy_version,
    }


def restore(st: PackerState, ev: Event) -> None:
    """Replaces ``st``'s content with a snapshot event's (applied as the WAL's first event
    after its header)."""
    st.execs, st.groups, st.micro_steps, st.held = {}, {}, {}, {}
    for gid, gd in ev["groups"].items():
        g = Group(
            GroupId(gid),
            size=int(gd["size"]),
            state=GroupState(gd["state"]),
            batch_id=int(gd["batch_id"]),
            advantages={k: float(v) for k, v in gd["adv"].items()},
            oldest_version=int(gd["oldest"]),
            gone={x: [int(i) for i in t] for x, t in gd.get("gone", {}).items()},
        )
        for x, ed in gd["execs"].items():
            e = Execution(ExecutionId(x), GroupId(gid))
            for tj in ed["turns"]:
                t = Turn.from_json(tj)
                e.turns[t.turn_index] = t
                if t.call_key:
                    e.call_keys[t.call_key] = t.turn_index
            e.finish = Finish.from_json(ed["finish"]) if ed["finish"] is not None else None
            # Snapshots from before segments hold a turn per packed sequence.
            segs = ed["segs"] if "segs" in ed else [[i] for i in sorted(e.turns)]
            e.segments = {int(s[0]): tuple(int(i) for i in s) for s in segs}
            g.execs[x] = e
            st.execs[x] = e
        st.groups[gid] = g
    st.ready = {gid: None for gid in ev["ready"]}
    st.batches = {}
    for b, bd in ev["batches"].items():
        bt = Batch(
            BatchId(int(b)),
            int(bd["size"]),
            version=bd["version"],
            groups=list(bd["groups"]),
            pending={(str(x), int(i)): None for x, i in bd["pending"]},
            participants=set(bd["participants"]),
            sealed=bd["sealed"],
            closed=bd["closed"],
            done=bd["done"],
            total_loss_tokens=int(bd["total"]),
            acked=int(bd["acked"]),
            packed_seqs=int(bd["packed_seqs"]),
            attempt=int(bd.get("attempt", 0)),
            committed=bool(bd.get("committed", bd["done"])),
            claim_keys={(str(c), str(k)): str(m) for c, k, m in bd.get("claim_keys", [])},
        )
        for md in bd["micro_steps"]:
            m = MicroStep(
                id=md["id"],
                batch_id=bt.id,
                index=int(md["index"]),
                seqs=[(str(x), int(i)) for x, i in md["seqs"]],
                n_seqs=int(md["n"]),
                loss_tokens=int(md["loss"]),
                packed_tokens=int(md["packed"]),
                holder=CellId(md["holder"]) if md["holder"] else None,
                acked_by=CellId(md["acked_by"]) if md["acked_by"] else None,
                released_from=CellId(md["released_from"]) if md.get("released_from") else None,
                # Snapshots from before leases: an ack was final.
                committed=bool(md.get("committed", md["acked_by"] is not None)),
            )
            bt.micro_steps.append(m)
            st.micro_steps[m.id] = m
            if m.holder is not None:
                st.held[m.id] = m
        bt.free = {mid: None for mid in bd["free"]}
        st.batches[bt.id] = bt
    st.filling = int(ev["filling"])
    st.seen_turns = {(str(x), int(i)): int(d) for x, i, d in ev["seen_turns"]}
    st.finished = {x: Finish.from_json(f) for x, f in ev["finished"].items()}
    st.resolved = set(ev["resolved"])
    st.forgettable = {
        gid: (int(b), {x: [int(i) for i in t] for x, t in m.items()})
        for gid, b, m in ev.get("forgettable", [])
    }
    st.produced, st.consumed = int(ev["produced"]), int(ev["consumed"])
    st.dropped = collections.Counter({k: int(v) for k, v in ev["dropped"].items()})
    st.groups_dropped = collections.Counter({k: int(v) for k, v in ev["groups_dropped"].items()})
    # A snapshot written before groups_filtered existed: its drops count as filtered (an
    # overestimate lets the gate dispatch a few groups early; an underestimate could stall it).
    st.groups_filtered = int(ev.get("groups_filtered", sum(st.groups_dropped.values())))
    st.claims_expired = int(ev["claims_expired"])
    st.policy_version = int(ev["policy_version"])


def compacted(st: PackerState) -> list[Event]:
    """The events a compacted WAL holds: its header (if the state has one) and a snapshot."""
    header: list[Event] = [{"t": "wal", "id": st.wal_id}] if st.wal_id else []
    return header + [to_event(st)]


def summary(ev: Event) -> dict[str, Any]:
    """A short description of a snapshot event, for logs."""
    return {"groups": len(ev["groups"]), "batches": len(ev["batches"]), "produced": ev["produced"]}
