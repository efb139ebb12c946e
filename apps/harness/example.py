"""The example harness: runs agent episodes for Gyre executions until the burst is done.

    python -m apps.harness.example --scheduler 127.0.0.1:50051 --concurrency 8

Each execution is acquired from the scheduler, its episode runs against the router's
OpenAI-compatible endpoint with the execution's token, and its reward is reported. The
harness and its workspaces live here, outside every GPU cell.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from apps.harness.env import EnvConfig, Episode, Task
from gyre.client import ExecutionHandle, HarnessClient
from gyre.errors import GyreError, Unavailable

log = logging.getLogger("apps.harness")

MODEL_CALL_TRIES = 3
"""Tries of one model call that the router lost (it died or restarted mid-call: sent, no
answer). A retry is safe: every try of a call carries the call's idempotency key, and the
packer keeps one turn per key, the answer the harness got (services/router/README.md,
"Several routers")."""
MODEL_CALL_RETRY_S = 0.5  # times the try: the router's supervisor restarts it meanwhile


@dataclass
class HarnessStats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    """Episodes the scheduler cancelled (their group could no longer be trained within the
    staleness bound): the harness saw a CANCELLED status, not a failure of its own."""
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (policy version, reward)
    turns: int = 0
    calls: int = 0
    """Model calls answered, of every episode (completed, failed or cancelled)."""


async def run_execution(execution: ExecutionHandle, env: EnvConfig, stats: HarnessStats) -> None:
    task = (
        Task.from_json(execution.task)
        if execution.task
        else Task(execution.task_id, 42, hash(execution.task_id) & 0xFFFF)
    )
    member = int(execution.execution_id.rsplit("-", 1)[-1]) if execution.execution_id[-1:].isdigit() else 0
    episode = Episode(task, env, member)

    async def chat(
        messages: list[dict[str, Any]], max_tokens: int, temperature: float, tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        key = uuid.uuid4().hex  # one per model call, the same for each of its tries
        for tries in range(1, MODEL_CALL_TRIES + 1):
            try:
                message = await execution.chat_message(
                    messages, max_tokens=max_tokens, temperature=temperature, tools=tools, idempotency_key=key
                )
                stats.calls += 1
                return message
            except Unavailable as exc:
                if tries == MODEL_CALL_TRIES:
                    raise
                log.info("model call lost (%s); retried", exc, extra={"execution_id": execution.execution_id})
                await asyncio.sleep(MODEL_CALL_RETRY_S * tries)
        raise AssertionError("unreachable")

    async with execution:
        try:
            result = await episode.run(chat, asyncio.sleep)
        except GyreError as exc:
            await execution.finish(status="failed")
            if execution.closed_as == "CANCELLED":  # the scheduler cancelled it under us
                log.info("episode cancelled by the scheduler", extra={"execution_id": execution.execution_id})
                stats.cancelled += 1
                return
            log.warning("episode failed: %s", exc, extra={"execution_id": execution.execution_id})
            stats.failed += 1
            return
        reply = await execution.finish(reward=result.reward)
        if reply.duplicate and execution.closed_as == "CANCELLED":
            stats.cancelled += 1  # it ended just after the scheduler cancelled it: not trained
            return
        stats.completed += 1
        stats.turns += result.turns
        stats.rewards.append((execution.policy_version, result.reward))


async def run_harness(
    scheduler_target: str,
    env: EnvConfig,
    concurrency: int = 8,
    max_executions: int | None = None,
    stop_when_exhausted: bool = True,
    harness_id: str = "",
    stop: asyncio.Event | None = None,
    stats: HarnessStats | None = None,
    tls_dir: str | None = None,
    insecure: bool = False,
) -> HarnessStats:
    """Runs up to ``concurrency`` executions at a time until the burst is exhausted (or
    ``max_executions``, or ``stop`` is set). ``stats`` is updated live if given."""
    stats = stats if stats is not None else HarnessStats()
    started = 0
    async with HarnessClient(
        scheduler_target, harness_id=harness_id, tls_dir=tls_dir, insecure=insecure
    ) as client:
        running: set[asyncio.Task[None]] = set()
        while stop is None or not stop.is_set():
            if max_executions is not None and started >= max_executions:
                break
            if len(running) >= concurrency:
                _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            execution = await client.acquire(wait_s=1.0)
            if execution is None:
                if client.last_burst_exhausted and stop_when_exhausted and not running:
                    break
                if running:
                    done, running = await asyncio.wait(
                        running, timeout=0.2, return_when=asyncio.FIRST_COMPLETED
                    )
                continue
            running.add(
                asyncio.create_task(
                    run_execution(execution, env.at(started), stats), name=execution.execution_id
                )
            )
            started += 1
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.harness.example")
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-executions", type=int, default=None)
    parser.add_argument("--env", default="{}", help="EnvConfig overrides as JSON")
    parser.add_argument(
        "--tls-dir",
        default=None,
        help="harness identity directory (default $GYRE_HARNESS_TLS_DIR); "
        "an API key comes from $GYRE_HARNESS_API_KEY_FILE or $GYRE_HARNESS_API_KEY",
    )
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext (a scheduler run with tls.insecure)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    env = EnvConfig(**json.loads(args.env))
    stats = asyncio.run(
        run_harness(
            args.scheduler,
            env,
            args.concurrency,
            args.max_executions,
            tls_dir=args.tls_dir,
            insecure=args.insecure,
        )
    )
    print(json.dumps({"completed": stats.completed, "failed": stats.failed, "turns": stats.turns}))
    return 0 if stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
