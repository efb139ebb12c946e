"""An example agent environment: multi-turn episodes with tools acting on a per-execution
workspace, heavy-tailed tool latencies, a per-task turn budget, and a reward that depends on
what the agent does with its tools.

The task: the workspace holds ``notes.txt`` (``secret=NN``) and one to three distractor
files from a small pool (``todo.txt``, ``data.txt``, ...), each holding another number
(``count=NN``, ...). The user turn lists the files (a JSON list, shuffled per task) and asks
for the secret. The agent is offered three tools the standard way (OpenAI ``tools``:
``list_files``, ``read_file``, ``write_file``); the calls it makes come back parsed by the
router (its own tokens choose the tool and its arguments) and are answered with
``role: tool`` messages. A reply without a tool call runs nothing: it is answered with a
short user nudge. The episode ends when the agent calls ``write_file`` (which writes
``answer.txt``) or at the task's turn budget.

The reward is computed from the workspace alone: 1.0 when ``answer.txt`` holds exactly the
secret, ``number_credit`` when it holds another number (one read from a distractor), 0
otherwise. The secret is only in ``notes.txt``: the best reward needs a ``read_file`` of the
right file and a ``write_file`` of what it said (a guess is right one time in 90). The
warm-started policy (:mod:`apps.model.warmstart`) reads a listed file at random; policy
gradient learns which one to read.

The shapes follow profile A of docs/design/workloads.md (SWE / terminal agent), scaled down so a demo run
takes minutes: the turn budget ~ LN(median, sigma) clipped, tool latency a three-way
lognormal mixture (fast / medium / rare slow calls times a per-task factor). Everything the
agent does lands in its workspace, a temporary directory that lives with the harness,
outside any GPU cell: that is what survives a role change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EnvConfig(BaseModel):
    """Episode shape. Times are in seconds of wall-clock (already scaled)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    turns_median: float = Field(4.0, gt=0, description="Median turn budget per task (lognormal).")
    turns_sigma: float = Field(0.5, ge=0, description="Log-sd of the turn budget.")
    turns_min: int = Field(2, ge=1, description="2: a read and a write fit every budget.")
    turns_max: int = Field(12, ge=1)
    max_tokens: int = Field(48, ge=1, le=4096, description="Model tokens per turn (a tool call is ~30).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (>0 for GRPO variance).")
    time_scale: float = Field(0.05, ge=0, description="Multiplies every tool latency of profile A.")
    tool_mix: tuple[float, float, float] = Field((0.60, 0.35, 0.05), description="P(fast, medium, slow).")
    tool_medians_s: tuple[float, float, float] = Field((0.3, 1.0, 20.0), description="Profile A medians.")
    tool_sigmas: tuple[float, float, float] = Field((0.8, 1.0, 1.0))
    task_factor_sigma: float = Field(1.2, ge=0, description="Log-sd of the per-task slow-tool factor.")
    tool_cap_s: float = Field(600.0, gt=0, description="Cap before scaling.")
    distractors_min: int = Field(1, ge=0, le=4, description="Distractor files per task.")
    distractors_max: int = Field(3, ge=0, le=4)
    phase_after: int = Field(
        0,
        ge=0,
        description="Executions a harness starts before its second phase (0: one phase). Real RL's "
        "workload changes during a run; the demo's second phase has slower tools.",
    )
    phase_time_scale: float = Field(0.0, ge=0, description="time_scale of the second phase.")
    number_credit: float = Field(
        0.1, ge=0, le=1, description="Reward for writing a number that is not the secret."
    )
    digit_credit: float = Field(
        0.01,
        ge=0,
        le=1,
        description="An episode that never wrote an answer earns this times the share of digits in its last "
        "reply: a policy that cannot call tools yet (a random model, the mock engines) still gets groups "
        "whose rewards differ, so GRPO has a signal; tiny next to a written number.",
    )

    def at(self, started: int) -> EnvConfig:
        """The episode shape of a harness's ``started``-th execution (counted from 0): the
        second phase's tool latencies from ``phase_after`` on."""
        if self.phase_after and started >= self.phase_after:
            return self.model_copy(update={"time_scale": self.phase_time_scale, "phase_after": 0})
        return self


SECRET_FILE = "notes.txt"
ANSWER_FILE = "answer.txt"
DISTRACTORS: tuple[tuple[str, str], ...] = (
    ("todo.txt", "count"),
    ("data.txt", "value"),
    ("log.txt", "code"),
    ("config.txt", "port"),
)
"""The distractor pool: (file name, the key of the number it holds)."""
NUDGE = "Use a tool."
"""The user turn that answers a reply without a tool call."""


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


@dataclasses.dataclass
class Task:
    """One task; the executions of a group share it (and its random draws). Its files follow
    from ``(secret, seed)``: the JSON the scheduler generates (``task_id``, ``secret``,
    ``seed``) is all it needs."""

    task_id: str
    secret: int
    seed: int

    def to_json(self) -> dict[str, object]:
        return {"task_id": self.task_id, "secret": self.secret, "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Task:
        return cls(str(data["task_id"]), int(str(data["secret"])), int(str(data["seed"])))

    def files(self, config: EnvConfig | None = None) -> dict[str, str]:
        """The workspace's files (name -> content), in the order the prompt lists them."""
        c = config or EnvConfig()
        rng = random.Random(self.seed ^ 0x5EC12E7)
        lo, hi = min(c.distractors_min, c.distractors_max), max(c.distractors_min, c.distractors_max)
        chosen = rng.sample(DISTRACTORS, rng.randint(lo, hi))
        numbers = rng.sample([n for n in range(10, 100) if n != self.secret], len(chosen))
        files = {SECRET_FILE: f"secret={self.secret}\n"}
        files.update({name: f"{key}={n}\n" for (name, key), n in zip(chosen, numbers, strict=True)})
        order = list(files)
        rng.shuffle(order)
        return {name: files[name] for name in order}


def make_tasks(n: int, seed: int = 0, prefix: str = "task") -> list[Task]:
    """``n`` tasks named ``{prefix}-{i}``. Held-out tasks use another prefix and seed
    (:func:`eval_tasks`): their ids never collide with the scheduler's ``task-{i}``."""
    rng = random.Random(seed)
    return [Task(f"{prefix}-{i}", rng.randrange(10, 100), rng.randrange(2**31)) for i in range(n)]


EVAL_SEED = 1_000_003
"""The held-out tasks' seed: the scheduler's generator (``services/scheduler/tasks.py``)
draws task i from ``Random(seed * 1_000_003 + i)``, ``make_tasks`` from ``Random(seed)``."""


def eval_tasks(n: int = 32, seed: int = EVAL_SEED) -> list[Task]:
    """Held-out tasks (``eval-{i}``), never trained on."""
    return make_tasks(n, seed=seed, prefix="eval")


class Workspace:
    """A per-execution directory with the task's files."""

    def __init__(self, task: Task, root: str | None = None, config: EnvConfig | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"gyre-ws-{task.task_id}-", dir=root))
        self.names = list(task.files(config))
        for name, content in task.files(config).items():
            (self.path / name).write_text(content)

    def list_files(self) -> str:
        """The file names as a JSON list (as the prompt lists them): names are then the same
        tokens in a listing and in a call's arguments."""
        return json.dumps(sorted(p.name for p in self.path.iterdir()))

    def read_file(self, name: str) -> str:
        target = (self.path / name).resolve()
        if target.parent != self.path.resolve() or not target.is_file():
            return f"error: no file {name}"
        return target.read_text()[:200]

    def write_answer(self, text: str) -> str:
        (self.path / ANSWER_FILE).write_text(text)
        return "ok"

    def answer(self) -> str:
        path = self.path / ANSWER_FILE
        return path.read_text() if path.exists() else ""

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def reply_credit(reply: str, digit_credit: float) -> float:
    """``digit_credit`` times the share of digits among the reply's non-space characters."""
    chars = [c for c in reply if not c.isspace()]
    return digit_credit * sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def reward_of(answer: str, secret: int, number_credit: float = 0.1) -> float:
    """1.0 for exactly the secret, ``number_credit`` for another number, else 0."""
    text = answer.strip()
    if text == str(secret):
        return 1.0
    return number_credit if re.fullmatch(r"\d+", text) else 0.0


Chat = Callable[[list[dict[str, Any]], int, float, list[dict[str, Any]]], Awaitable[dict[str, Any]]]
"""(messages, max_tokens, temperature, tools) -> the assistant message (OpenAI's
``choices[0].message``: ``content`` and, when the model called tools, ``tool_calls``)."""


def _tool(name: str, description: str, arg: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": {}}
    if arg is not None:
        params = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS: list[dict[str, Any]] = [
    _tool("list_files", "List the files."),
    _tool("read_file", "Read a file.", "path"),
    _tool("write_file", "Write the answer.", "text"),
]
"""Short schemas: the chat template renders them into every prompt's system turn."""
Sleep = Callable[[float], Awaitable[None]]


@dataclasses.dataclass
class EpisodeResult:
    reward: float
    turns: int
    """Turns taken (model calls): the write's turn, or the budget."""
    tool_time_s: float
    answer: str
    calls: list[str] = dataclasses.field(default_factory=list)
    """The tool calls made, in order, as ``name(argument)``: ``read_file(notes.txt)``."""

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


class Episode:
    """One execution of a task: the agent loop, its tools and its workspace."""

    SYSTEM = "You are an agent with tools."

    def __init__(self, task: Task, config: EnvConfig, member: int = 0) -> None:
        self.task = task
        self.config = config
        # Turn budget and tool-latency factor are per task (shared by the group), the
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

    def prompt(self) -> list[dict[str, Any]]:
        """The first messages: the system turn and the task."""
        files = json.dumps(list(self.task.files(self.config)))
        return [
            {"role": "system", "content": self.SYSTEM},
            {"role": "user", "content": f"Files: {files}\nFind the secret number and write it."},
        ]

    def tool_latency_s(self) -> float:
        c = self.config
        u = self.rng.random()
        kind = 0 if u < c.tool_mix[0] else 1 if u < c.tool_mix[0] + c.tool_mix[1] else 2
        latency = _lognormal(self.rng, c.tool_medians_s[kind], c.tool_sigmas[kind])
        if kind == 2:
            latency *= self.task_factor
        return min(latency, c.tool_cap_s) * c.time_scale

    def call_tool(self, workspace: Workspace, name: str, arguments: str) -> tuple[str, str]:
        """Runs a tool call the model made: (result, the call as ``name(argument)``)."""
        try:
            args = json.loads(arguments) if arguments else {}
        except ValueError:
            return f"error: arguments of {name} are not JSON", f"{name}(?)"
        if not isinstance(args, dict):
            return f"error: arguments of {name} must be an object", f"{name}(?)"
        if name == "list_files":
            return workspace.list_files(), "list_files()"
        if name == "read_file":
            path = str(args.get("path", ""))
            return workspace.read_file(path), f"read_file({path})"
        if name == "write_file":
            text = str(args.get("text", ""))
            return workspace.write_answer(text), f"write_file({text})"
        return f"error: no tool {name}", f"{name}(?)"

    async def run(self, chat: Chat, sleep: Sleep, workspace_root: str | None = None) -> EpisodeResult:
        workspace = Workspace(self.task, workspace_root, self.config)
        tool_time = 0.0
        calls_made: list[str] = []
        turns = 0
        wrote = False
        reply = ""
        try:
            messages = self.prompt()
            for _ in range(self.turns):
                turns += 1
                message = await chat(messages, self.config.max_tokens, self.config.temperature, TOOLS)
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
                reply = str(message.get("content") or "")
                # Every turn waits for the environment (a tool, or the harness's nudge): the
                # latencies of profile A make episodes long and uneven whatever the policy does.
                latency = self.tool_latency_s()
                await sleep(latency)
                tool_time += latency
                if not calls:  # a reply is just a reply: nothing runs
                    messages.append({"role": "user", "content": NUDGE})
                    continue
                for call in calls:
                    fn = call.get("function", {})
                    name = str(fn.get("name", ""))
                    result, shown = self.call_tool(workspace, name, str(fn.get("arguments", "")))
                    calls_made.append(shown)
                    wrote = wrote or name == "write_file"
                    messages.append(
                        {"role": "tool", "tool_call_id": call.get("id", ""), "content": result[:120]}
                    )
                if wrote:
                    break
            answer = workspace.answer()
            reward = reward_of(answer, self.task.secret, self.config.number_credit)
            if not wrote:
                reward += reply_credit(reply, self.config.digit_credit)
            return EpisodeResult(
                reward,
                turns,
                tool_time,
                answer,
                calls_made,
            )
        finally:
            workspace.cleanup()
