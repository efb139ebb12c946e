"""Test helpers for the packer: a manual clock, record builders, and a full-state replay
check (shared by unit, integration and fault tests and the benchmark)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from gyre.execution import ExecutionStatus
from gyre.history import History
from gyre.v1 import common_pb2, packer_pb2
from services.packer.config import PackerConfig
from services.packer.history import HistoryLog
from services.packer.model import ClaimOutcome, ClaimResult, Finish, Turn
from services.packer.packer import Packer
from services.packer.state import PackerState
from services.packer.wal import MemoryLog
from testkit.clock import ManualClock


def config(**overrides: Any) -> PackerConfig:
    base: dict[str, Any] = {
        "batch_size": 2,
        "micro_step_token_budget": 64,
        "policy_from_etcd": False,
        "ready_grace_s": 0.0,
        "restart_grace_s": 0.0,
    }
    base.update(overrides)
    return PackerConfig(**base)


def make_packer(**overrides: Any) -> tuple[Packer, MemoryLog, ManualClock]:
    log, clock = MemoryLog(), ManualClock()
    packer = Packer(config(**overrides), log, clock=clock)
    packer.recover([])
    return packer, log, clock


def turn(x: str, g: str, i: int = 0, prompt: int = 4, output: int = 4, version: int = 0, **kw: Any) -> Turn:
    """A valid turn with ``prompt`` prompt tokens and ``output`` output tokens."""
    return Turn.validated(
        x,
        g,
        i,
        kw.get("prompt_ids", range(1, prompt + 1)),
        kw.get("output_ids", range(100, 100 + output)),
        kw.get("logprobs", [-0.5] * output),
        kw.get("versions", [version] * output),
        kw.get("mask", []),
        kw.get("max_tokens", 1 << 20),
        kw.get("call_key", ""),
        kw.get("chat_state", ""),
        kw.get("temperature", 1.0),
    )


def finish(
    x: str,
    g: str,
    size: int,
    reward: float = 1.0,
    status: ExecutionStatus = ExecutionStatus.COMPLETED,
    version: int = 0,
) -> Finish:
    return Finish.validated(x, g, size, status, reward, version, 1 << 16)


def turn_proto(
    x: str, g: str, i: int = 0, prompt: int = 4, output: int = 4, version: int = 0
) -> packer_pb2.TurnRecord:
    return packer_pb2.TurnRecord(
        execution_id=x,
        group_id=g,
        turn_index=i,
        prompt_token_ids=list(range(1, prompt + 1)),
        output_token_ids=list(range(100, 100 + output)),
        output_logprobs=[-0.5] * output,
        output_policy_versions=[version] * output,
    )


def finish_proto(x: str, g: str, size: int, reward: float = 1.0, version: int = 0) -> packer_pb2.FinishReport:
    return packer_pb2.FinishReport(
        execution_id=x,
        group_id=g,
        group_size=size,
        status=common_pb2.EXECUTION_STATUS_COMPLETED,
        reward=reward,
        policy_version=version,
    )


async def feed_group(
    packer: Packer, g: str, size: int = 2, turns: int = 1, prompt: int = 4, output: int = 4
) -> None:
    """Records ``turns`` turns for each of ``size`` executions of group ``g`` and finishes
    them with distinct rewards (so the group is never zero-variance)."""
    for k in range(size):
        x = f"{g}-x{k}"
        for i in range(turns):
            await packer.record_turn(turn(x, g, i, prompt, output))
        await packer.report_finish(finish(x, g, size, reward=float(k)))


async def claimed_ids(packer: Packer, cell: str) -> list[str]:
    """The ids of the micro-steps of batch 1 that ``cell`` claims, one at a time (version 0,
    no wait), until a claim gets none."""
    got = []
    while (r := await packer.claim(cell, 1, 0, 0)).outcome is ClaimOutcome.CLAIMED:
        got.append(r.micro_step.micro_step_id)
    return got


async def history_run(history: History, commits: int = 1) -> None:
    """A real packer (micro-steps of 16 tokens) writing ``history``, then closing it: two
    groups, a first attempt at batch 1 that acks one micro-step and fails, a second that
    acks them all, and ``commits`` commits (a retried commit is not a second step)."""
    p, log, _ = make_packer(micro_step_token_budget=16)
    p.log = HistoryLog(log, history)
    await p.open_batch("core", 1)
    await feed_group(p, "g1", size=2, turns=2)
    await feed_group(p, "g2", size=2, turns=1)
    first = await claimed_ids(p, "core")
    await p.ack("core", 1, first[0])
    await p.open_batch("core", 1)  # a failed attempt
    for ms in await claimed_ids(p, "core"):
        await p.ack("core", 1, ms)
    for _ in range(commits):
        await p.commit("core", 1)
    history.close()


async def feed_stub(stub: Any, groups: int, size: int = 3, turns: int = 2, base: int = 0) -> None:
    """Over gRPC (a ``PackerStub``): records ``turns`` turns for each of ``size`` executions of
    groups ``g<base>`` .. ``g<base + groups - 1>`` and finishes them, every group at once."""
    import asyncio

    async def one(g: int) -> None:
        for k in range(size):
            x = f"g{g}-x{k}"
            for i in range(turns):
                await stub.RecordTurn(
                    turn_proto(x, f"g{g}", i, prompt=4 + g % 3, output=3 + g % 4), timeout=10
                )
            await stub.ReportFinish(finish_proto(x, f"g{g}", size, reward=float(k)), timeout=10)

    await asyncio.gather(*(one(g) for g in range(base, base + groups)))


def episode(
    x: str, g: str, turns: int, rng: random.Random, edit_at: int = -1, version: int = 3
) -> list[Turn]:
    """Turns of a token-consistent episode (each prompt = previous prompt + output + an
    observation), except at ``edit_at`` where the history is rewritten."""
    out: list[Turn] = []
    context = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))]
    for i in range(turns):
        if i == edit_at:
            context = [rng.randrange(3, 500) for _ in range(4)]  # a summary replaces history
        n = rng.randrange(1, 6)
        output = [rng.randrange(3, 500) for _ in range(n)]
        mask = [1] * n if i != 1 else [1] * (n - 1) + [0]
        out.append(
            turn(
                x,
                g,
                i,
                prompt_ids=list(context),
                output_ids=output,
                logprobs=[-0.1 * (j + 1) for j in range(n)],
                versions=[version + i] * n,
                mask=mask,
            )
        )
        context = context + output + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 5))]
    return out


async def claim_episodes(packer: Packer, g: str, episodes: dict[str, list[Turn]]) -> ClaimResult:
    """Records the turns of each execution of group ``g`` (``episodes``: its turns by
    execution id) and finishes it (reward: its place in ``episodes``), makes the group ready
    and claims the current batch's first micro-step as cell ``c``."""
    for k, (x, turns) in enumerate(episodes.items()):
        for t in turns:
            await packer.record_turn(t)
        await packer.report_finish(finish(x, g, len(episodes), reward=float(k)))
    await packer.reap()
    return await packer.claim("c", 0, 0, 0)


def snapshot(state: PackerState) -> dict[str, Any]:
    """A comparable summary of a state (what a replay must reproduce); also runs the deep
    invariant check."""
    state.check(deep=True)
    return {
        "counters": state.counters(),
        "groups": {
            g: (
                grp.state.value,
                grp.batch_id,
                sorted(grp.execs),
                grp.size,
                sorted(grp.advantages.items()),
                grp.oldest_version,
                sorted((x, sorted(e.turns), e.finish) for x, e in grp.execs.items()),
            )
            for g, grp in state.groups.items()
        },
        "seen_turns": sorted(state.seen_turns.items()),
        "finished": sorted(state.finished.items()),
        "ready": list(state.ready),
        "batches": {
            b: (
                bt.size,
                bt.version,
                list(bt.groups),
                list(bt.pending),
                bt.sealed,
                bt.closed,
                bt.done,
                bt.total_loss_tokens,
                sorted(bt.participants),
                sorted(bt.free),
                bt.packed_seqs,
                bt.acked,
            )
            for b, bt in state.batches.items()
        },
        "micro_steps": {
            m: (ms.batch_id, list(ms.seqs), ms.holder, ms.acked_by, ms.loss_tokens, ms.released_from)
            for m, ms in state.micro_steps.items()
        },
        "filling": state.filling,
        "held": sorted(state.held),
        "resolved": sorted(state.resolved),
        "forgettable": list(state.forgettable.items()),
    }


def write_config(tmp_path: Any, etcd_server: Any, cluster_name: str, **packer: Any) -> Any:
    """A cluster YAML for one packer process on a test etcd; returns its path."""
    import yaml

    section: dict[str, Any] = {
        "wal_dir": str(tmp_path / "wal"),
        "batch_size": 4,
        "micro_step_token_budget": 48,
        "claim_ttl_s": 2.0,
        "reap_interval_s": 0.2,
        "lease_ttl_s": 3,
        "log_level": "WARNING",
        "max_message_bytes": 1 << 20,
        "ready_grace_s": 0.0,
        "restart_grace_s": 0.0,
        "check_every_change": True,  # tests recount the invariants after every change
    }
    section.update(packer)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
                "packer": section,
            }
        )
    )
    return path


def replayed(events: list[dict[str, Any]]) -> PackerState:
    state = PackerState()
    for ev in events:
        state.apply(ev)
    return state


def asdict(obj: Any) -> Any:
    return dataclasses.asdict(obj)
