"""Packer under random operation sequences (hypothesis): records, finishes, claims, acks,
expiries, policy moves, seals and restarts in any order. After every operation the deep
invariants hold (conservation, no turn in two live micro-steps, free list in step); a
refused operation changes nothing; no turn is ever trained twice; and the WAL replays to
the state that wrote it."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.errors import GyreError
from gyre.execution import ExecutionStatus
from services.packer.model import ClaimOutcome
from services.packer.packer import Packer
from services.packer.wal import MemoryLog
from testkit import packer_kit as tk

_group = st.tuples(
    st.just("group"),
    st.integers(4, 9),
    st.sampled_from([2, 3]),
    st.integers(1, 2),
    st.lists(st.booleans(), min_size=3, max_size=3),
    st.integers(0, 1),
)
_drain = st.tuples(st.just("drain"), st.integers(0, 3), st.integers(0, 2))
ops = st.one_of(
    st.tuples(
        st.just("turn"),
        st.integers(0, 3),
        st.integers(0, 2),
        st.integers(0, 2),
        st.integers(1, 20),
        st.integers(1, 12),
        st.integers(0, 2),
    ),
    st.tuples(
        st.just("finish"),
        st.integers(0, 3),
        st.integers(0, 2),
        st.sampled_from([2, 3]),
        st.booleans(),
        st.integers(0, 2),
    ),
    st.tuples(st.just("claim"), st.integers(0, 3), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("ack"), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("ack_foreign"), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("advance"), st.floats(0, 8)),
    st.tuples(st.just("policy"), st.integers(0, 3)),
    st.tuples(st.just("seal"), st.integers(0, 3)),
    st.tuples(st.just("restart")),
    # Whole groups and draining cells (listed twice: drawn more often), so that batches
    # fill, seal, close and finish.
    _group,
    _group,
    _drain,
    _drain,
)


async def attempt(p: Packer, call) -> None:  # type: ignore[no-untyped-def]
    """One primitive call inside a composite operation: a refusal must change nothing."""
    before = tk.snapshot(p.state)
    try:
        await call
    except GyreError:
        assert tk.snapshot(p.state) == before


def _fresh_packer(batch_size: int, token_budget: int, fill: float) -> tuple[Packer, tk.ManualClock]:
    """A recovered-empty packer on a manual clock (claims live 5 s, a failed member leaves the
    rest of its group, any group trains), and its clock."""
    packer, _, clock = tk.make_packer(
        batch_size=batch_size,
        micro_step_token_budget=token_budget,
        claim_ttl_s=5.0,
        emit_fill_fraction=fill,
        failed_member_rule="keep_rest",
        min_group_members=1,
        drop_zero_variance=False,
    )
    return packer, clock


async def run(program: list[tuple]) -> None:
    p, clock = _fresh_packer(2, 32, 0.6)
    cfg = p.cfg
    claims: dict[str, list[tuple[str, int]]] = {}  # micro-step -> its turns, from claim answers
    held: list[tuple[str, int, str]] = []  # (cell, batch, micro-step) as the cells believe
    trained: list[tuple[str, int]] = []
    claimed_by: dict[str, set[str]] = {}  # micro-step -> cells it was ever handed to

    def got(cell: str, ms) -> None:  # type: ignore[no-untyped-def]
        claims[ms.micro_step_id] = [
            (t.execution_id, t.turn_index) for s in ms.sequences for t in s.segment.turns
        ]
        claimed_by.setdefault(ms.micro_step_id, set()).add(cell)

    def acked(cell: str, mid: str) -> None:
        assert cell in claimed_by.get(mid, set()), f"{cell} acknowledged {mid} it never claimed"
        trained.extend(claims[mid])

    for op in program:
        before = tk.snapshot(p.state)
        try:
            kind = op[0]
            if kind == "turn":
                _, g, x, i, n_p, n_o, v = op
                await p.record_turn(tk.turn(f"g{g}-x{x}", f"g{g}", i, n_p, n_o, version=v))
            elif kind == "finish":
                _, g, x, size, ok, r = op
                status = ExecutionStatus.COMPLETED if ok else ExecutionStatus.FAILED
                await p.report_finish(tk.finish(f"g{g}-x{x}", f"g{g}", size, reward=float(r), status=status))
            elif kind == "claim":
                _, cell, batch, version = op
                res = await p.claim(f"c{cell}", batch, version, 0)
                if res.outcome is ClaimOutcome.CLAIMED:
                    got(f"c{cell}", res.micro_step)
                    held.append((f"c{cell}", res.batch_id, res.micro_step.micro_step_id))
            elif kind == "ack":
                _, cell, k = op
                mine = [h for h in held if h[0] == f"c{cell}"]
                if mine:
                    c, b, mid = mine[k % len(mine)]
                    held.remove((c, b, mid))
                    if not await p.ack(c, b, mid):
                        acked(c, mid)
            elif kind == "ack_foreign":
                # A cell acknowledges a micro-step somebody else was handed.
                _, cell, k = op
                if held:
                    _, b, mid = held[k % len(held)]
                    if not await p.ack(f"c{cell}", b, mid):
                        acked(f"c{cell}", mid)
            elif kind == "advance":
                clock.advance(op[1])
                await p.reap()
            elif kind == "policy":
                await p.observe_policy(op[1])
            elif kind == "seal":
                await p.seal(op[1], epoch=1)
            elif kind == "group":
                _, g, size, turns, ok, v = op
                for x in range(size):
                    for i in range(turns):
                        await attempt(
                            p, p.record_turn(tk.turn(f"g{g}-x{x}", f"g{g}", i, 3 + x, 2 + i, version=v))
                        )
                for x in range(size):
                    status = ExecutionStatus.COMPLETED if ok[x] else ExecutionStatus.FAILED
                    await attempt(
                        p,
                        p.report_finish(
                            tk.finish(f"g{g}-x{x}", f"g{g}", size, reward=float(x), status=status)
                        ),
                    )
            elif kind == "drain":
                # A cell claims and acks up to a few micro-steps of the current batch.
                _, cell, n = op
                for _ in range(n + 1):
                    version = p.batch_status(0)["policy_version"]  # what JoinBatch would say
                    step_before = tk.snapshot(p.state)
                    try:
                        res = await p.claim(f"c{cell}", 0, version, 0)
                    except GyreError:
                        assert tk.snapshot(p.state) == step_before
                        break
                    if res.outcome is not ClaimOutcome.CLAIMED:
                        break
                    ms = res.micro_step
                    got(f"c{cell}", ms)
                    if not await p.ack(f"c{cell}", res.batch_id, ms.micro_step_id):
                        acked(f"c{cell}", ms.micro_step_id)
            elif kind == "restart":
                log = MemoryLog()
                log.events = list(p.log.events)  # type: ignore[attr-defined]
                p = Packer(cfg, log, clock=clock)
                p.recover(log.events)
                assert tk.snapshot(p.state) == before
        except GyreError:
            assert tk.snapshot(p.state) == before, f"refused {op} but the state changed"
        p.state.check(deep=True)
        assert len(trained) == len(set(trained)), f"a turn was trained twice after {op}"
    assert p.state.consumed == len(trained)
    assert tk.snapshot(tk.replayed(p.log.events)) == tk.snapshot(p.state)  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=5, max_size=60))
def test_random_operation_sequences_keep_the_invariants(program):
    asyncio.run(run(program))


async def simulate(seed: int, steps: int) -> dict[str, int]:
    """A long seeded run with the shapes of real traffic: whole groups arriving, cells
    claiming on the current batch at its version, acking (sometimes twice, sometimes another
    cell's), dying with claims held, the clock running claims out, policy moves, seals and
    packer restarts."""
    import random

    rng = random.Random(seed)
    p, clock = _fresh_packer(3, 40, 0.7)
    cfg = p.cfg
    cells = [f"c{i}" for i in range(4)]
    held: dict[str, list[tuple[int, str]]] = {c: [] for c in cells}
    claims: dict[str, list[tuple[str, int]]] = {}
    claimed_by: dict[str, set[str]] = {}
    acked_by: dict[str, str] = {}
    trained: list[tuple[str, int]] = []
    stats: dict[str, int] = {}
    next_group = 0

    def count(key: str) -> None:
        stats[key] = stats.get(key, 0) + 1

    for _ in range(steps):
        before = tk.snapshot(p.state)
        roll = rng.random()
        cell = rng.choice(cells)
        try:
            if roll < 0.25:
                g, next_group = f"g{next_group}", next_group + 1
                size, turns = rng.choice([2, 3]), rng.choice([1, 2])
                version = max(0, p.state.policy_version - rng.choice([0, 0, 1, 2]))
                for x in range(size):
                    for i in range(turns):
                        await p.record_turn(
                            tk.turn(f"{g}-x{x}", g, i, rng.randint(2, 12), rng.randint(1, 8), version=version)
                        )
                for x in rng.sample(range(size), size):
                    ok = rng.random() > 0.1
                    status = ExecutionStatus.COMPLETED if ok else ExecutionStatus.FAILED
                    await p.report_finish(tk.finish(f"{g}-x{x}", g, size, reward=float(x), status=status))
                count("group")
            elif roll < 0.55:
                version = (
                    p.batch_status(0)["policy_version"]
                    if p.batch_status(0)["active"]
                    else p.state.policy_version
                )
                res = await p.claim(cell, 0, version, 0)
                count("claim_" + res.outcome.value)
                if res.outcome is ClaimOutcome.CLAIMED:
                    ms = res.micro_step
                    claims[ms.micro_step_id] = [
                        (t.execution_id, t.turn_index) for s in ms.sequences for t in s.segment.turns
                    ]
                    claimed_by.setdefault(ms.micro_step_id, set()).add(cell)
                    held[cell].append((res.batch_id, ms.micro_step_id))
            elif roll < 0.85:
                foreign = rng.random() < 0.15
                pool = (
                    [(c, h) for c in cells for h in held[c]] if foreign else [(cell, h) for h in held[cell]]
                )
                if pool:
                    owner, (b, mid) = rng.choice(pool)
                    dup = await p.ack(cell, b, mid)
                    if not foreign or owner == cell:
                        held[owner].remove((b, mid))
                    if dup:
                        assert acked_by[mid] == cell
                        count("ack_dup")
                    else:
                        assert cell in claimed_by[mid], f"{cell} acknowledged {mid} it never claimed"
                        assert mid not in acked_by
                        acked_by[mid] = cell
                        trained.extend(claims[mid])
                        count("ack")
                    if rng.random() < 0.1:
                        assert await p.ack(cell, b, mid) is True  # a retried ack
            elif roll < 0.90:
                clock.advance(rng.uniform(0, 7))
                if await p.reap():
                    count("expired")
            elif roll < 0.92:
                await p.observe_policy(p.state.policy_version + 1)
                count("policy")
            elif roll < 0.95:
                await p.seal(0, epoch=1)
                count("seal")
            elif roll < 0.97:
                held[cell] = []  # the cell dies holding its claims
                count("death")
            else:
                events = list(p.log.events)  # type: ignore[attr-defined]
                log = MemoryLog()
                log.events = events
                p = Packer(cfg, log, clock=clock)
                p.recover(events)
                assert tk.snapshot(p.state) == before
                count("restart")
        except GyreError:
            assert tk.snapshot(p.state) == before
            count("refused")
        assert len(trained) == len(set(trained))
    assert p.state.consumed == len(trained)
    assert tk.snapshot(tk.replayed(p.log.events)) == tk.snapshot(p.state)  # type: ignore[attr-defined]
    return stats


def test_long_seeded_runs_train_every_turn_at_most_once():
    for seed in range(4):
        stats = asyncio.run(simulate(seed, 700))
        # The run exercised what it claims to (so that the test can fail).
        for key in ("group", "claim_claimed", "ack", "expired", "restart", "seal", "refused"):
            assert stats.get(key, 0) > 0, (seed, key, stats)
