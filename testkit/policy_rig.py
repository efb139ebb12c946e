"""Snapshots for the policy unit tests: cells, a snapshot around a pipeline, and the
pipelines of the asynchronous policy's tests (eta = 1, a heavy trainer)."""

from __future__ import annotations

from typing import Any

from services.scheduler.policy import (
    CellKind,
    CellState,
    CellView,
    LedgerCounts,
    Pipeline,
    Snapshot,
    Supply,
    VersionCounts,
)


def cells(states: list[CellState], slots: int = 10, loads: list[int] | None = None) -> tuple[CellView, ...]:
    """Elastic cells c0, c1, ... in ``states``, each of ``slots`` slots (``loads`` running)."""
    loads = loads or [0] * len(states)
    return tuple(CellView(f"c{i}", CellKind.ELASTIC, i, s, slots, loads[i]) for i, s in enumerate(states))


def snap(
    views: tuple[CellView, ...],
    p: Pipeline,
    v: int = 1,
    needs: int | None = None,
    execs: tuple[Any, ...] = (),
    quota: int = 0,
) -> Snapshot:
    """A snapshot of the cells ``views`` and pipeline ``p``; ``quota``: executions the task source still
    has (0: nothing to dispatch, so W_eta is what ``p`` holds)."""
    needs = p.batch_groups - p.batch_assigned if needs is None else needs
    return Snapshot(
        100.0,
        LedgerCounts(0, 0, 0),
        views,
        Supply(min(p.ready_groups, needs), p.batch_groups, needs, v),
        None,
        v,
        quota,
        None,
        p,
        execs,
    )


def eta1_pipeline(open_executions: int, **kw: Any) -> Pipeline:
    """eta = 1, groups of 4, 1,000 tokens/s per training cell, ready groups arriving at 0.05/s,
    ``open_executions`` dispatched and running at v1; ``kw`` sets or overrides the rest."""
    base: dict[str, Any] = {
        "max_staleness": 1,
        "group_size": 4,
        "train_rate_per_cell": 1000.0,
        "ready_rate": 0.05,
        "versions": (
            VersionCounts(
                1, groups=open_executions // 4, dispatched=open_executions, launched=open_executions
            ),
        ),
        "published_version": 1,
    }
    return Pipeline(**{**base, **kw})


def heavy_pipeline(open_executions: int, **kw: Any) -> Pipeline:
    """A heavy trainer (B64's shape at eta = 1): batches of 20 groups of 5e4 tokens arriving
    at 0.05 groups/s, 1,000 tokens/s per training cell: a rate target above 1."""
    return eta1_pipeline(open_executions, batch_groups=20, tokens_per_group=5e4, **kw)
