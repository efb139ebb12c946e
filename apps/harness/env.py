"""An example agent environment: multi-turn episodes with tools acting on a per-execution
workspace, heavy-tailed turn counts and tool latencies, and a reward a tiny model can learn.

The shapes follow WORKLOADS.md profile A (SWE / terminal agent), scaled down so a demo run
takes minutes: turns ~ LN(median, sigma) clipped, tool latency a three-way lognormal
mixture (fast / medium / rare slow calls times a per-task factor). Everything the agent
does lands in its workspace, a temporary directory that lives with the harness, outside any
GPU cell: that is what survives a role change.

The task: the workspace holds ``notes.txt`` with a secret number. The agent is offered its
tools the standard way (OpenAI ``tools``); a tool call it makes comes back as
``tool_calls`` and is answered with a ``role: tool`` message. A reply without a tool call
(what a random tiny model writes) is run ReAct-style through a tool chosen from the reply
and answered with a user message. Written replies land in ``answer.txt``. The reward is
computed from the workspace alone: the fraction of characters in ``answer.txt`` that are
digits, plus a bonus when the secret appears. A random tiny model writes few digits;
group-relative policy gradient on this reward visibly raises it within a few policy
versions, which is what the demo shows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EnvConfig(BaseModel):
    """Episode shape. Times are in seconds of wall-clock (already scaled)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    turns_median: float = Field(3.0, gt=0, description="Median turns per episode (lognormal).")
    turns_sigma: float = Field(0.6, ge=0, description="Log-sd of turns per episode.")
    turns_min: int = Field(1, ge=1)
    turns_max: int = Field(12, ge=1)
    max_tokens: int = Field(16, ge=1, le=4096, description="Model tokens per turn.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (>0 for GRPO variance).")
    time_scale: float = Field(0.05, ge=0, description="Multiplies every tool latency of profile A.")
    tool_mix: tuple[float, float, float] = Field((0.60, 0.35, 0.05), description="P(fast, medium, slow).")
    tool_medians_s: tuple[float, float, float] = Field((0.3, 1.0, 20.0), description="Profile A medians.")
    tool_sigmas: tuple[float, float, float] = Field((0.8, 1.0, 1.0))
    task_factor_sigma: float = Field(1.2, ge=0, description="Log-sd of the per-task slow-tool factor.")
    tool_cap_s: float = Field(600.0, gt=0, description="Cap before scaling.")
    digit_bonus: float = Field(0.5, ge=0, description="Reward bonus when the secret number appears.")


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


@dataclasses.dataclass
class Task:
    """One task; the executions of a group share it (and its random draws)."""

    task_id: str
    secret: int
    seed: int

    def to_json(self) -> dict[str, object]:
        return {"task_id": self.task_id, "secret": self.secret, "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Task:
        return cls(str(data["task_id"]), int(str(data["secret"])), int(str(data["seed"])))


def make_tasks(n: int, seed: int = 0, prefix: str = "task") -> list[Task]:
    rng = random.Random(seed)
    return [Task(f"{prefix}-{i}", rng.randrange(10, 100), rng.randrange(2**31)) for i in range(n)]


class Workspace:
    """A per-execution directory with the task's files."""

    def __init__(self, task: Task, root: str | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"gyre-ws-{task.task_id}-", dir=root))
        (self.path / "notes.txt").write_text(f"The secret number is {task.secret}.\n")
        (self.path / "answer.txt").write_text("")

    def list_files(self) -> str:
        return " ".join(sorted(p.name for p in self.path.iterdir()))

    def read_file(self, name: str) -> str:
        target = (self.path / name).resolve()
        if target.parent != self.path.resolve() or not target.exists():
            return f"error: no file {name}"
        return target.read_text()[:200]

    def append_answer(self, text: str) -> str:
        with open(self.path / "answer.txt", "a") as f:
            f.write(text + "\n")
        return "ok"

    def answer(self) -> str:
        return (self.path / "answer.txt").read_text()

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def reward_of(answer: str, secret: int, bonus: float) -> float:
    """Fraction of non-space characters that are digits, plus a bonus for the secret."""
    chars = [c for c in answer if not c.isspace()]
    if not chars:
        return 0.0
    frac = sum(c.isdigit() for c in chars) / len(chars)
    return frac + (bonus if str(secret) in answer else 0.0)


Chat = Callable[[list[dict[str, Any]], int, float, list[dict[str, Any]]], Awaitable[dict[str, Any]]]
"""(messages, max_tokens, temperature, tools) -> the assistant message (OpenAI's
``choices[0].message``: ``content`` and, when the model called tools, ``tool_calls``)."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the workspace files.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Append text to answer.txt.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    },
]
Sleep = Callable[[float], Awaitable[None]]


@dataclasses.dataclass
class EpisodeResult:
    reward: float
    turns: int
    tool_time_s: float
    answer: str


class Episode:
    """One execution of a task: the agent loop, its tools and its workspace."""

    SYSTEM = "You are a coding agent. Use tools: list_files, read_file, write_file. Answer with the number."

    def __init__(self, task: Task, config: EnvConfig, member: int = 0) -> None:
        self.task = task
        self.config = config
        # Turn count and tool-latency factor are per task (shared by the group), the
        # individual draws per member: groups differ in length, members a little.
        task_rng = random.Random(task.seed)
        self.turns = int(
            min(
                config.turns_max,
                max(config.turns_min, round(_lognormal(task_rng, config.turns_median, config.turns_sigma))),
            )
        )
        self.task_factor = _lognormal(task_rng, 1.0, config.task_factor_sigma)
        self.rng = random.Random(task.seed * 1000 + member)

    def tool_latency_s(self) -> float:
        c = self.config
        u = self.rng.random()
        kind = 0 if u < c.tool_mix[0] else 1 if u < c.tool_mix[0] + c.tool_mix[1] else 2
        latency = _lognormal(self.rng, c.tool_medians_s[kind], c.tool_sigmas[kind])
        if kind == 2:
            latency *= self.task_factor
        return min(latency, c.tool_cap_s) * c.time_scale

    def call_tool(self, workspace: Workspace, name: str, arguments: str) -> str:
        """Runs a tool call the model made."""
        try:
            args = json.loads(arguments) if arguments else {}
        except ValueError:
            return f"error: arguments of {name} are not JSON"
        if not isinstance(args, dict):
            return f"error: arguments of {name} must be an object"
        if name == "list_files":
            return "files: " + workspace.list_files()
        if name == "read_file":
            return workspace.read_file(str(args.get("path", "")))
        if name == "write_file":
            return workspace.append_answer(str(args.get("text", "")))
        return f"error: no tool {name}"

    def run_tool(self, workspace: Workspace, reply: str, turn: int) -> str:
        """Picks a tool from a reply without tool calls (what a random tiny model writes) and
        runs it, the way a ReAct harness reads an action out of text."""
        choice = (sum(map(ord, reply)) + turn) % 3
        if choice == 0:
            return "files: " + workspace.list_files()
        if choice == 1:
            return "notes.txt: " + workspace.read_file("notes.txt")
        return "write_file answer.txt: " + workspace.append_answer(reply)

    async def run(self, chat: Chat, sleep: Sleep, workspace_root: str | None = None) -> EpisodeResult:
        workspace = Workspace(self.task, workspace_root)
        tool_time = 0.0
        try:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": self.SYSTEM},
                {
                    "role": "user",
                    "content": f"Task {self.task.task_id}: find the secret number and write it.",
                },
            ]
            for turn in range(self.turns):
                message = await chat(messages, self.config.max_tokens, self.config.temperature, TOOLS)
                reply = message.get("content") or ""
                calls = message.get("tool_calls") or []
                # The history carries the assistant message exactly as it came back, so the
                # router continues the execution's tokens instead of re-rendering them.
                messages.append(
                    {
                        "role": "assistant",
                        "content": message.get("content"),
                        **({"tool_calls": calls} if calls else {}),
                    }
                )
                latency = self.tool_latency_s()
                await sleep(latency)
                tool_time += latency
                if calls:
                    for call in calls:
                        fn = call.get("function", {})
                        result = self.call_tool(
                            workspace, str(fn.get("name", "")), str(fn.get("arguments", ""))
                        )
                        messages.append(
                            {"role": "tool", "tool_call_id": call.get("id", ""), "content": result[:120]}
                        )
                    observation = "tools called"
                else:
                    observation = self.run_tool(workspace, reply, turn)
                    messages.append({"role": "user", "content": observation[:120]})
                if turn == self.turns - 1 and "write_file" not in observation:
                    workspace.append_answer(reply)  # the final reply is always the answer
            answer = workspace.answer()
            return EpisodeResult(
                reward_of(answer, self.task.secret, self.config.digit_bonus), self.turns, tool_time, answer
            )
        finally:
            workspace.cleanup()
