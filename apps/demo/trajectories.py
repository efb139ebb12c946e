"""Token-consistency and training-token figures of a run, from the packer's event log (what
was actually recorded and trained, not what the router says about itself), read through the
packer's API (``Packer.ReadLog``, as an operator) while the run's services are up, or from
its WAL file afterwards:

    python -m apps.demo.trajectories RUN_DIR/packer-wal

For every execution with recorded turns: how many consecutive turns are token-consistent
(turn k+1's prompt starts with turn k's prompt + output), how many segments it splits into
(the packer's rule, services/packer/segments.py), and its training tokens trained per
segment against what training every turn with its whole prompt would cost. The packed
tokens of every micro-step the packer emitted are checked against the segment lengths
computed here independently.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from gyre.grpcx.tls import TlsFiles
from services.packer.model import Turn
from services.packer.segments import continues, split_segments
from services.packer.state import PackerState
from services.packer.wal import WAL_NAME


def read_events(wal_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of a WAL file (read only; the line format is ``crc32 json``)."""
    events = []
    for line in (Path(wal_dir) / WAL_NAME).read_text().splitlines():
        _, _, body = line.partition(" ")
        if body:
            events.append(json.loads(body))
    return events


async def read_log(target: str, tls: TlsFiles, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Every event of the packer's log, through its API (``Packer.ReadLog``; ``tls``: an
    operator's identity)."""
    from gyre.grpcx.channel import dial
    from gyre.identity import Role
    from gyre.v1 import packer_pb2, packer_pb2_grpc

    events: list[dict[str, Any]] = []
    async with dial(target, tls, expect=Role.PACKER) as channel:
        stream = packer_pb2_grpc.PackerStub(channel).ReadLog(packer_pb2.ReadLogRequest(), timeout=timeout_s)
        async for chunk in stream:
            events += [json.loads(e) for e in chunk.events]
    return events


def analyze(events: list[dict[str, Any]]) -> dict[str, Any]:
    turns: dict[str, dict[int, Turn]] = {}
    state = PackerState()
    emitted_tokens = 0
    expected_tokens = 0
    compacted = False
    for ev in events:
        if ev["t"] == "turn":
            t = Turn.from_json(ev["turn"])
            turns.setdefault(t.execution_id, {})[t.turn_index] = t
        compacted = compacted or ev["t"] == "snapshot"
        state.apply(ev)
        if ev["t"] == "emit":
            emitted_tokens += state.micro_steps[ev["ms"]].packed_tokens
            for x, i in ev["seqs"]:
                if x not in turns:  # recorded before a compaction: its turns are in the snapshot
                    continue
                (seg,) = [s for s in split_segments(turns[x]) if s[0] == int(i)]
                last = turns[x][seg[-1]]
                expected_tokens += len(last.prompt) + len(last.output)
    pairs = consistent = 0
    segments: list[int] = []
    seg_tokens: list[int] = []
    turn_tokens: list[int] = []
    for ex in turns.values():
        order = sorted(ex)
        for a, b in itertools.pairwise(order):
            pairs += 1
            consistent += continues(ex[a], ex[b])
        segs = split_segments(ex)
        segments.append(len(segs))
        seg_tokens.append(sum(len(ex[s[-1]].prompt) + len(ex[s[-1]].output) for s in segs))
        turn_tokens.append(sum(t.tokens for t in ex.values()))
    n = len(turns)
    return {
        "executions": n,
        "multi_turn_executions": sum(1 for ex in turns.values() if len(ex) > 1),
        "turns": sum(len(ex) for ex in turns.values()),
        "consecutive_turn_pairs": pairs,
        "token_consistent_pairs": consistent,
        "segment_breaks": pairs - consistent,
        "token_consistent_share": round(consistent / pairs, 4) if pairs else None,
        "segments_per_episode": round(statistics.fmean(segments), 3) if n else None,
        "training_tokens_per_episode": round(statistics.fmean(seg_tokens), 1) if n else None,
        "per_turn_tokens_per_episode": round(statistics.fmean(turn_tokens), 1) if n else None,
        "training_tokens_total": sum(seg_tokens),
        "per_turn_tokens_total": sum(turn_tokens),
        "emitted_packed_tokens": emitted_tokens,
        "emitted_segment_tokens": expected_tokens,
        "emitted_tokens_match_segments": emitted_tokens == expected_tokens,
        "wal_compacted": compacted,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.demo.trajectories")
    parser.add_argument("wal_dir")
    args = parser.parse_args(argv)
    print(json.dumps(analyze(read_events(args.wal_dir)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
