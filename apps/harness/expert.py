"""A scripted, deliberately imperfect agent for the example task (apps/harness/env.py): the
demonstrations the warm start (apps/model/warmstart.py) imitates.

It is a ``Chat`` (messages, max_tokens, temperature, tools) -> assistant message, deciding
from the conversation alone, so it runs through :meth:`apps.harness.env.Episode.run` like a
model. Per episode: ``list_files`` first with probability ``p_list``; then ``read_file`` of a
listed file it has not read, ``notes.txt`` with probability ``p_notes`` (None: uniformly
among the files); then, after reading a distractor, another read with probability ``p_more``
(otherwise it writes the distractor's number: the imperfection RL removes); after reading
the secret, ``write_file`` of it. Its tool calls are exactly what the router parses out of the
hermes format, so an imitating model learns the format and the copying, and inherits the
expert's indifference to which file holds the secret.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from apps.harness.env import DISTRACTORS, SECRET_FILE

_KEY_VALUE = re.compile(r"^([a-z]+)=(\d+)\s*$")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The model-side text of a tool call, as the chat template renders it (hermes)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def _message(name: str, arguments: dict[str, Any], n: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_expert_{n}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        ],
    }


class Expert:
    """One episode's scripted agent (its draws come from ``rng``).

    With probability ``p_slip`` a read is a *slip* instead: a call of a file that is not
    there, or a call cut off mid-way (what the router cannot parse). A slip is marked
    (:attr:`slipped` lists the turns), so imitation keeps it in the context but does not
    learn it: the policy sees how to go on after its own mistakes (read a listed file), which
    it would otherwise never see."""

    def __init__(
        self,
        rng: random.Random,
        p_list: float = 0.25,
        p_notes: float | None = None,
        p_more: float = 0.0,
        p_slip: float = 0.0,
    ) -> None:
        self.rng = rng
        self.p_list = p_list
        self.p_notes = p_notes
        self.p_more = p_more
        self.p_slip = p_slip
        self.slipped: list[int] = []
        """The turns (0-based) that were slips."""

    def decide(self, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        """(tool name, arguments) of the next call."""
        files = _listed_files(messages)
        reads = _reads(messages)
        if not any(m["role"] == "assistant" for m in messages) and self.rng.random() < self.p_list:
            return "list_files", {}
        if reads:
            key, number = reads[-1][1]
            unread = [f for f in files if f not in {name for name, _ in reads}]
            if key and key != "secret" and unread and self.rng.random() < self.p_more:
                return "read_file", {"path": self._pick(unread)}
            if number:
                return "write_file", {"text": number}
        unread = [f for f in files if f not in {name for name, _ in reads}] or files
        return "read_file", {"path": self._pick(unread)}

    def _pick(self, files: list[str]) -> str:
        if self.p_notes is not None and SECRET_FILE in files:
            others = [f for f in files if f != SECRET_FILE]
            if not others or self.rng.random() < self.p_notes:
                return SECRET_FILE
            return self.rng.choice(others)
        return self.rng.choice(files)

    def _slip(self, messages: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
        listed = set(_listed_files(messages))
        absent = [name for name, _ in DISTRACTORS if name not in listed]
        if self.rng.random() < 0.5 and absent:
            return _message("read_file", {"path": self.rng.choice(absent)}, n)
        text = tool_call_text("read_file", {"path": self.rng.choice(sorted(listed) or [SECRET_FILE])})
        return {"role": "assistant", "content": text[: self.rng.randrange(8, len(text) - 14)]}

    async def __call__(
        self, messages: list[dict[str, Any]], max_tokens: int, temperature: float, tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        n = sum(m["role"] == "assistant" for m in messages)
        name, arguments = self.decide(messages)
        if name == "read_file" and self.p_slip and n not in self.slipped and self.rng.random() < self.p_slip:
            slip = self._slip(messages, n)
            if slip is not None:
                self.slipped.append(n)
                return slip
        return _message(name, arguments, n)


def _listed_files(messages: list[dict[str, Any]]) -> list[str]:
    for m in messages:
        if m["role"] == "user" and str(m.get("content") or "").startswith("Files: "):
            names = json.loads(str(m["content"]).splitlines()[0][len("Files: ") :])
            return [str(n) for n in names]
    return []


def _reads(messages: list[dict[str, Any]]) -> list[tuple[str, tuple[str, str]]]:
    """[(file, (key, number))] of every read_file answered so far, in order."""
    pending: dict[str, str] = {}
    out: list[tuple[str, tuple[str, str]]] = []
    for m in messages:
        if m["role"] == "assistant":
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                if fn.get("name") == "read_file":
                    try:
                        pending[call.get("id", "")] = str(
                            json.loads(fn.get("arguments") or "{}").get("path", "")
                        )
                    except (ValueError, AttributeError):
                        pass
        elif m["role"] == "tool" and m.get("tool_call_id", "") in pending:
            match = _KEY_VALUE.match(str(m.get("content") or ""))
            out.append(
                (pending.pop(m["tool_call_id"]), (match.group(1), match.group(2)) if match else ("", ""))
            )
    return out
