"""Token-in, token-out trajectories: an execution's tokens only grow.

The router keeps, per execution, the token sequence of its last completed model call
(prompt + every generated token, the stop token included) and, for chat calls, the
messages and tools that call was rendered from and the assistant message it answered with.
A new chat call whose history is the old one plus that assistant message plus new messages
gets the prompt

    previous prompt + exactly the tokens generated
      + the rest of the template's closing of the assistant turn (e.g. "\\n" after <|im_end|>)
      + the tokens of the appended messages, rendered by the chat template as a delta

so generated text is never re-tokenized (it does not round-trip), the engine's prefix cache
hits on the whole previous context, and what is trained is what the policy conditioned on.
The delta is the chat template applied to the whole new history minus its application to
the history up to that assistant message, so tools, tool results and generation prompt are
rendered by the model's own template. Where the harness changed history (truncation,
summarization, edited messages, other tools) or the template is not prefix-stable, the call
is rendered from scratch and starts a new *segment* of the trajectory; the break is counted
with its reason. Token-level calls (``/v1/completions`` with token ids, gRPC ``Generate``)
continue the sequence when their prompt extends it, and break it otherwise.

Verl's agent loop and slime keep multi-turn rollouts token-in/token-out the same way
(append generated ids, tokenize only the new messages through the template); this module
differs in checking the history instead of trusting it, so a harness that edits history
costs a counted segment, not silently wrong training data.

:class:`TrajectoryStore` holds the state in this router's memory: it is the one class to
replace with a durable store (etcd, the packer) when routers become stateless.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from services.router.tokenization import Tokenizer

_SENTINEL = "\x00gyre-assistant-content\x00"


@dataclasses.dataclass(frozen=True)
class ChatState:
    """What a completed chat call was rendered from, and what it answered."""

    messages: tuple[dict[str, Any], ...]
    tools: str  # canonical JSON of the tools (the template renders them)
    reply: tuple[str, tuple[tuple[str, str], ...]]  # (content, ((name, canonical arguments), ...))


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One execution's token sequence after its last completed call."""

    tokens: tuple[int, ...]
    prompt_len: int
    segment: int
    turns: int
    chat: ChatState | None = None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A planned call: its prompt, and why it does not continue the trajectory (None: it
    does; "first": the execution's first call)."""

    token_ids: list[int]
    break_reason: str | None


def canonical_tools(tools: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"))


def reply_key(
    content: str | None, tool_calls: Sequence[dict[str, Any]]
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """An assistant message reduced to what the template renders: its text and its calls'
    names and arguments (ids and argument formatting do not matter)."""
    calls = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        calls.append((str(fn.get("name", "")), json.dumps(args, sort_keys=True)))
    return (content or "", tuple(calls))


def chat_prompt(
    tok: Tokenizer, prev: Trajectory | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> Prompt:
    """The prompt of a chat call given the execution's trajectory (blocking: run it off the
    event loop). ``messages`` are normalized (:func:`normalize_messages`)."""
    full = tok.render(messages, tools, add_generation_prompt=True)
    if prev is None:
        return Prompt(tok.encode(full), "first")
    reason = _history_differs(prev, messages, tools)
    if reason is not None:
        return Prompt(tok.encode(full), reason)
    assert prev.chat is not None
    k = len(prev.chat.messages)
    with_reply = tok.render(messages[: k + 1], tools, add_generation_prompt=False)
    if not full.startswith(with_reply):
        return Prompt(tok.encode(full), "template_not_prefix_stable")
    closing = _closing(tok, messages[:k], tools)
    if closing is None:
        return Prompt(tok.encode(full), "template_not_prefix_stable")
    generated = tok.decode(prev.tokens[prev.prompt_len :], skip_special_tokens=False)
    delta = closing[_overlap(generated, closing) :] + full[len(with_reply) :]
    return Prompt(list(prev.tokens) + tok.encode(delta), None)


def _history_differs(
    prev: Trajectory, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> str | None:
    chat = prev.chat
    if chat is None:
        return "no_chat_state"  # the previous call was token-level
    k = len(chat.messages)
    if canonical_tools(tools) != chat.tools:
        return "tools_changed"
    if len(messages) <= k or tuple(messages[:k]) != chat.messages:
        return "history_edited"
    reply = messages[k]
    if reply["role"] != "assistant" or reply_key(reply["content"], reply.get("tool_calls", ())) != chat.reply:
        return "reply_edited"
    return None


def _closing(tok: Tokenizer, history: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str | None:
    """What the template writes after an assistant message's content (ChatML: "<|im_end|>\\n")."""
    text = tok.render(
        [*history, {"role": "assistant", "content": _SENTINEL}], tools, add_generation_prompt=False
    )
    at = text.rfind(_SENTINEL)
    return None if at < 0 else text[at + len(_SENTINEL) :]


def _overlap(generated: str, closing: str) -> int:
    """Length of the longest end of ``generated`` that begins ``closing`` (the stop token
    the model generated is the start of the template's closing)."""
    for n in range(min(len(generated), len(closing)), 0, -1):
        if generated.endswith(closing[:n]):
            return n
    return 0


class TrajectoryStore:
    """Every live execution's trajectory, in this router's memory, and the consistency
    counters (turns that continued their execution's sequence, segment breaks by reason)."""

    def __init__(self) -> None:
        self._by_execution: dict[str, Trajectory] = {}
        self.turns = 0
        self.continued = 0
        self.breaks: collections.Counter[str] = collections.Counter()

    def get(self, execution_id: str) -> Trajectory | None:
        return self._by_execution.get(execution_id)

    def record(
        self,
        execution_id: str,
        prompt: Sequence[int],
        output: Sequence[int],
        chat: ChatState | None = None,
        break_reason: str | None = None,
    ) -> Trajectory:
        """A call completed: its tokens become the execution's sequence. Whether it
        continued the sequence is decided on the tokens (the prompt extends the previous
        call's prompt + output), ``break_reason`` only names why not."""
        prev = self._by_execution.get(execution_id)
        self.turns += 1
        if prev is None:
            segment = 0
        elif len(prompt) >= len(prev.tokens) and tuple(prompt[: len(prev.tokens)]) == prev.tokens:
            self.continued += 1
            segment = prev.segment
        else:
            self.breaks[break_reason or "prompt_differs"] += 1
            segment = prev.segment + 1
        traj = Trajectory(
            tuple(prompt) + tuple(output), len(prompt), segment, (prev.turns if prev else 0) + 1, chat
        )
        self._by_execution[execution_id] = traj
        return traj

    def attach_chat(self, execution_id: str, trajectory: Trajectory, chat: ChatState) -> bool:
        """Adds what a chat call was rendered from and answered to the trajectory it made;
        False (nothing changes) when another call completed since."""
        if self._by_execution.get(execution_id) is not trajectory:
            return False
        self._by_execution[execution_id] = dataclasses.replace(trajectory, chat=chat)
        return True

    def forget(self, execution_id: str) -> None:
        self._by_execution.pop(execution_id, None)

    def __len__(self) -> int:
        return len(self._by_execution)
