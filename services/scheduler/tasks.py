"""Task sources: where the tasks of a burst come from (a JSONL file or a built-in generator).

A source is indexed: task ``i`` is always the same task, so a new leader that knows how many
tasks earlier bursts took (the sum over burst records) continues where the old one stopped.
The built-in generator makes tasks for the example environment (``apps.harness.env``):
``{"task_id", "secret", "seed"}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Protocol

from services.scheduler.ledger import Task


class TaskSource(Protocol):
    """Tasks by index; ``take`` returns fewer than asked (maybe none) when it runs out."""

    def take(self, start: int, n: int) -> list[Task]: ...


class GeneratedTasks:
    """Deterministic example tasks: task i depends only on (seed, i)."""

    def __init__(self, seed: int = 0, limit: int = 0) -> None:
        self._seed = seed
        self._limit = limit

    def task(self, i: int) -> Task:
        rng = random.Random(self._seed * 1_000_003 + i)
        task_id = f"task-{i}"
        body = {"task_id": task_id, "secret": rng.randrange(10, 100), "seed": rng.randrange(2**31)}
        return Task(task_id, json.dumps(body))

    def take(self, start: int, n: int) -> list[Task]:
        end = start + n if not self._limit else min(start + n, self._limit)
        return [self.task(i) for i in range(start, end)]


class FileTasks:
    """Tasks from a JSONL file, one JSON object a line; ``task_id`` (or ``id``) names it,
    else the line number. With ``loop`` the file starts over when it runs out."""

    def __init__(self, path: str, loop: bool = True) -> None:
        self._tasks: list[Task] = []
        for n, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            body = json.loads(line)
            if not isinstance(body, dict):
                raise ValueError(f"{path}:{n + 1}: a task must be a JSON object")
            task_id = str(body.get("task_id", body.get("id", f"line-{n + 1}")))
            self._tasks.append(Task(task_id, json.dumps(body)))
        if not self._tasks:
            raise ValueError(f"{path}: no tasks")
        self._loop = loop

    def take(self, start: int, n: int) -> list[Task]:
        out = []
        for i in range(start, start + n):
            if i >= len(self._tasks) and not self._loop:
                break
            out.append(self._tasks[i % len(self._tasks)])
        return out


def make_task_source(tasks_file: str, seed: int, loop: bool) -> TaskSource:
    return FileTasks(tasks_file, loop) if tasks_file else GeneratedTasks(seed)
