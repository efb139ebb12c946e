"""The example environment: the reward is computed from the workspace alone, episodes are
reproducible per task and member, turn counts and tool latencies are heavy-tailed as in
WORKLOADS.md profile A, and the workspace is removed after the episode."""

from __future__ import annotations

import statistics
from pathlib import Path

from apps.harness.env import EnvConfig, Episode, Task, make_tasks, reward_of


def test_reward_counts_digits_and_secret():
    assert reward_of("", 42, 0.5) == 0.0
    assert reward_of("ab cd", 42, 0.5) == 0.0
    assert reward_of("12 34", 42, 0.5) == 1.0
    assert reward_of("a 42", 42, 0.5) == 2 / 3 + 0.5


def test_episode_shape_is_reproducible_and_heavy_tailed():
    cfg = EnvConfig(time_scale=1.0)
    tasks = make_tasks(400, seed=3)
    turns = [Episode(t, cfg).turns for t in tasks]
    assert turns == [Episode(t, cfg).turns for t in tasks]
    assert min(turns) >= cfg.turns_min and max(turns) <= cfg.turns_max
    latencies = [Episode(t, cfg, member=1).tool_latency_s() for t in tasks]
    med, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * len(latencies))]
    assert 0.1 < med < 2.0  # mostly fast calls ...
    assert p99 > 10 * med  # ... and a heavy tail


async def test_episode_uses_a_workspace_and_cleans_it(tmp_path: Path):
    seen: list[Path] = []
    task = Task("t", 42, 7)
    episode = Episode(task, EnvConfig(time_scale=0.0))

    async def chat(messages, max_tokens, temperature, tools):
        seen.extend(tmp_path.iterdir())
        return {"role": "assistant", "content": "the answer is 42"}

    async def no_sleep(_):
        return None

    result = await episode.run(chat, no_sleep, workspace_root=str(tmp_path))
    assert result.turns == episode.turns
    assert "42" in result.answer and result.reward > 0.5
    assert seen and not list(tmp_path.iterdir())


async def test_tool_calls_are_answered_with_tool_messages(tmp_path: Path):
    """A model that calls the offered tools gets role: tool answers; its history carries the
    assistant message (with tool_calls) exactly as it came back."""
    task = Task("t", 42, 7)
    episode = Episode(task, EnvConfig(time_scale=0.0, turns_min=3, turns_max=3))
    histories: list[list] = []
    plan = [
        [("read_file", '{"path": "notes.txt"}')],
        [("write_file", '{"text": "42"}'), ("list_files", "{}")],
        [],
    ]

    async def chat(messages, max_tokens, temperature, tools):
        assert {t["function"]["name"] for t in tools} == {"list_files", "read_file", "write_file"}
        histories.append([dict(m) for m in messages])
        calls = plan[len(histories) - 1]
        if not calls:
            return {"role": "assistant", "content": "done: 42"}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ],
        }

    async def no_sleep(_):
        return None

    result = await episode.run(chat, no_sleep, workspace_root=str(tmp_path))
    second = histories[1]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert second[-1] == {"role": "tool", "tool_call_id": "call_0", "content": "The secret number is 42.\n"}
    third = histories[2]
    assert [m["role"] for m in third[-3:]] == ["assistant", "tool", "tool"]
    assert third[-1]["content"].startswith("files: ")
    assert result.answer.startswith("42\n") and result.reward > 0.5
