"""The demo task (apps/harness/env.py): the reward is computed from the workspace alone and
its best value needs the tools (read the file that holds the secret, write what it said); a
reply without a tool call runs nothing; the episode ends at the write or at the task's turn
budget; tasks are those the scheduler generates, held-out tasks never among them; the
scripted expert's tool calls are what the router parses out of the model's text."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from apps.harness.env import (
    NUDGE,
    SECRET_FILE,
    TOOLS,
    EnvConfig,
    Episode,
    Task,
    eval_tasks,
    make_tasks,
    reward_of,
)
from apps.harness.expert import Expert, tool_call_text
from services.scheduler.tasks import GeneratedTasks

ENV = EnvConfig(time_scale=0.0, turns_min=4, turns_max=4)
TASK = Task("t", 42, 7)


async def no_sleep(_: float) -> None:
    return None


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def scripted(*replies: dict[str, Any], seen: list[list[dict[str, Any]]] | None = None):
    plan = list(replies)

    async def chat(messages, max_tokens, temperature, tools):
        assert {t["function"]["name"] for t in tools} == {"list_files", "read_file", "write_file"}
        if seen is not None:
            seen.append([dict(m) for m in messages])
        return plan.pop(0) if plan else {"role": "assistant", "content": "done"}

    return chat


def distractor(task: Task) -> tuple[str, int]:
    name, content = next((n, c) for n, c in task.files(ENV).items() if n != SECRET_FILE)
    return name, int(content.split("=")[1])


def test_reward_is_the_secret_written_with_partial_credit_for_a_number():
    assert reward_of("42", 42) == 1.0
    assert reward_of("42\n", 42) == 1.0
    assert reward_of("17", 42, 0.1) == 0.1
    assert reward_of("the answer is 42", 42) == 0.0  # exactly the secret, nothing else
    assert reward_of("", 42) == 0.0


def test_task_files_hold_the_secret_in_notes_and_other_numbers_elsewhere():
    for task in make_tasks(50, seed=1):
        files = task.files(ENV)
        assert files == task.files(ENV)  # a function of the task alone
        assert files[SECRET_FILE] == f"secret={task.secret}\n"
        others = [int(c.split("=")[1]) for n, c in files.items() if n != SECRET_FILE]
        assert ENV.distractors_min <= len(others) <= ENV.distractors_max
        assert task.secret not in others and all(10 <= n < 100 for n in others)
    orders = {tuple(t.files(ENV)).index(SECRET_FILE) for t in make_tasks(50, seed=1)}
    assert len(orders) > 1  # the prompt lists the files shuffled: no position gives it away


async def test_reading_notes_then_writing_the_secret_gets_the_best_reward(tmp_path: Path):
    seen: list[list[dict[str, Any]]] = []
    chat = scripted(call("read_file", path="notes.txt"), call("write_file", text="42"), seen=seen)
    result = await Episode(TASK, ENV).run(chat, no_sleep, workspace_root=str(tmp_path))
    assert result.reward == 1.0 and result.success
    assert result.turns == 2  # the write ends the episode, within the budget of 4
    assert result.calls == ["read_file(notes.txt)", "write_file(42)"]
    assert seen[1][-1] == {"role": "tool", "tool_call_id": "call_read_file", "content": "secret=42\n"}
    assert seen[1][-2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert not list(tmp_path.iterdir())  # the workspace is removed


async def test_writing_without_reading_or_after_reading_a_distractor_gets_less(tmp_path: Path):
    name, number = distractor(TASK)
    guess = await Episode(TASK, ENV).run(scripted(call("write_file", text="57")), no_sleep, str(tmp_path))
    wrong = await Episode(TASK, ENV).run(
        scripted(call("read_file", path=name), call("write_file", text=str(number))), no_sleep, str(tmp_path)
    )
    assert guess.reward == wrong.reward == ENV.number_credit < 1.0
    assert wrong.calls == [f"read_file({name})", f"write_file({number})"]


async def test_a_reply_without_tool_calls_runs_no_tool(tmp_path: Path):
    seen: list[list[dict[str, Any]]] = []
    chat = scripted(
        {"role": "assistant", "content": "write_file 42"}, {"role": "assistant", "content": "42"}, seen=seen
    )
    episode = Episode(TASK, ENV)
    result = await episode.run(chat, no_sleep, workspace_root=str(tmp_path))
    assert result.calls == [] and result.answer == "" and result.reward == 0.0
    assert result.turns == episode.turns == 4  # nothing ended it before the budget
    assert seen[1][-2:] == [
        {"role": "assistant", "content": "write_file 42"},
        {"role": "user", "content": NUDGE},
    ]


async def test_tool_errors_are_answered_and_the_episode_goes_on(tmp_path: Path):
    seen: list[list[dict[str, Any]]] = []
    bad_json = call("read_file")
    bad_json["tool_calls"][0]["function"]["arguments"] = "{not json"
    chat = scripted(
        call("list_files"),
        call("read_file", path="../etc/passwd"),
        call("run_tests"),
        bad_json,
        seen=seen,
    )
    env = EnvConfig(time_scale=0.0, turns_min=5, turns_max=5)
    result = await Episode(TASK, env).run(chat, no_sleep, workspace_root=str(tmp_path))
    assert json.loads(seen[1][-1]["content"]) == sorted(TASK.files(env))  # as the prompt lists them
    assert [m[-1]["content"] for m in seen[2:]] == [
        "error: no file ../etc/passwd",
        "error: no tool run_tests",
        "error: arguments of read_file are not JSON",
    ]
    assert result.turns == 5 and result.reward == 0.0


def test_turn_budget_and_tool_latency_keep_the_profile_a_shape():
    cfg = EnvConfig(time_scale=1.0)
    tasks = make_tasks(400, seed=3)
    turns = [Episode(t, cfg).turns for t in tasks]
    assert turns == [Episode(t, cfg).turns for t in tasks]
    assert min(turns) >= cfg.turns_min >= 2 and max(turns) <= cfg.turns_max
    assert len(set(turns)) >= 4  # uneven budgets
    latencies = [Episode(t, cfg, member=1).tool_latency_s() for t in tasks]
    med, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * len(latencies))]
    assert 0.1 < med < 2.0 and p99 > 10 * med  # mostly fast calls, and a heavy tail


def test_a_second_phase_of_slower_tools_follows_the_first():
    from apps.demo.runner import DEMO_ENV

    cfg = EnvConfig(phase_after=3, phase_time_scale=0.25)
    assert [cfg.at(i).time_scale for i in range(5)] == [0.05, 0.05, 0.05, 0.25, 0.25]
    assert EnvConfig().at(10_000) == EnvConfig()  # one phase unless asked
    task = make_tasks(1, seed=3)[0]
    fast, slow = (Episode(task, DEMO_ENV.at(i), member=1).tool_latency_s() for i in (0, DEMO_ENV.phase_after))
    assert slow == pytest.approx(5 * fast)  # the demo's second phase: the same draws, 5x slower


def test_tasks_are_the_schedulers_and_held_out_tasks_are_disjoint():
    generated = [Task.from_json(json.loads(t.task_json)) for t in GeneratedTasks(seed=0).take(0, 200)]
    assert all(10 <= t.secret < 100 and t.files(ENV)[SECRET_FILE] for t in generated)
    held_out = eval_tasks(64)
    assert held_out == eval_tasks(64)
    assert {t.task_id for t in held_out}.isdisjoint(
        {t.task_id for t in generated} | {t.task_id for t in make_tasks(200)}
    )
    assert all(t.task_id.startswith("eval-") for t in held_out)
    assert Task.from_json(held_out[0].to_json()) == held_out[0]


def test_prompts_stay_short():
    from apps.model.tiny import build_tokenizer

    path = Path(__import__("tempfile").mkdtemp())
    tok = build_tokenizer(path)
    prompt = tok.apply_chat_template(Episode(TASK, ENV).prompt(), tools=TOOLS, add_generation_prompt=True)
    n = len(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    assert n < 400
    assert len(tok.encode(tool_call_text("read_file", {"path": "notes.txt"}))) < ENV.max_tokens - 8


@pytest.mark.parametrize("p_notes", [1.0, 0.0])
async def test_the_expert_reads_a_file_and_writes_what_it_read(tmp_path: Path, p_notes: float):
    rewards = []
    for i, task in enumerate(make_tasks(20, seed=2)):
        expert = Expert(random.Random(i), p_list=0.5, p_notes=p_notes)
        result = await Episode(task, EnvConfig(time_scale=0.0, turns_min=3, turns_max=3)).run(
            expert, no_sleep, str(tmp_path)
        )
        assert result.calls[-1].startswith("write_file(")
        rewards.append(result.reward)
    assert set(rewards) == ({1.0} if p_notes == 1.0 else {ENV.number_credit})


async def test_tool_call_text_is_what_the_template_renders_and_the_router_parses():
    from services.router.tokenization import Tokenizer
    from services.router.toolcalls import ToolCallParsers

    path = Path(__import__("tempfile").mkdtemp())
    from apps.model.tiny import build_tokenizer

    hf = build_tokenizer(path)
    message = call("read_file", path="notes.txt")
    rendered = hf.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {
                **message,
                "tool_calls": [
                    {
                        **message["tool_calls"][0],
                        "function": {"name": "read_file", "arguments": {"path": "notes.txt"}},
                    }
                ],
            },
        ],
        tools=TOOLS,
        tokenize=False,
    )
    text = tool_call_text("read_file", {"path": "notes.txt"})
    assert f"<|im_start|>assistant\n{text}<|im_end|>" in rendered
    parser = await ToolCallParsers("hermes", Tokenizer(hf, "tiny")).new(TOOLS, "tiny")
    content, calls = parser.parse(text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("read_file", {"path": "notes.txt"})
    ]


async def test_an_episode_that_never_writes_earns_only_the_tiny_digit_credit():
    """A policy that cannot call tools (the mock engines' random tokens) still gets rewards
    that differ within a group, so the packer does not drop every group as zero-variance."""
    from apps.harness.env import Episode, eval_tasks

    async def no_sleep(_: float) -> None:
        return None

    def replying(text: str):
        async def chat(messages, max_tokens, temperature, tools):
            return {"role": "assistant", "content": text}

        return chat

    task = eval_tasks(1)[0]
    digits = await Episode(task, ENV).run(replying("12 ab"), no_sleep)
    letters = await Episode(task, ENV).run(replying("abcd"), no_sleep)
    assert letters.reward == 0.0 and 0 < digits.reward <= ENV.digit_credit
    assert digits.reward == ENV.digit_credit * 2 / 4
