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

:class:`TrajectoryStore` holds the state in this router's memory, and no router holds state
another needs: every turn record carries its call's :class:`ChatState` (digests), so a router
that holds nothing of an execution, or an older state than its history shows (another router
served the calls since, or this one restarted), continues it from the packer's last turn
(``Packer.GetTrajectory``: :meth:`services.router.manager.CallManager.resume`, chosen by
``OpenAIApi._plan_chat``; a packer that does not answer is waited for, bounded, never
guessed around). A retried call (the harness's idempotency key of the call that made the
state) continues what that call continued.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from services.router.tokenization import Tokenizer

_SENTINEL = "\x00gyre-assistant-content\x00"


@dataclasses.dataclass(frozen=True)
class ChatState:
    """What a completed chat call was rendered from and answered, as digests: the number of
    its messages and digests of those messages, of its tools and of its reply (what the
    template renders of it). It travels in the call's turn record (:meth:`encode`), so any
    router can check that a next call's history extends it."""

    count: int
    messages: str
    tools: str
    reply: str

    @classmethod
    def of(
        cls,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        content: str | None,
        tool_calls: Sequence[dict[str, Any]],
    ) -> ChatState:
        return cls(len(messages), _digest(messages), _digest(tools), _digest(reply_key(content, tool_calls)))

    def encode(self) -> str:
        return f"{_VERSION}:{self.count}:{self.messages}:{self.tools}:{self.reply}"

    @classmethod
    def decode(cls, text: str) -> ChatState | None:
        """None for "" (a token-level call) or a form this router does not know."""
        parts = text.split(":")
        if len(parts) != 5 or parts[0] != _VERSION or not parts[1].isdigit():
            return None
        return cls(int(parts[1]), parts[2], parts[3], parts[4])


_VERSION = "c1"


def _digest(value: Any) -> str:
    """A digest of a JSON value (messages, tools, a reply key); key order does not matter."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One execution's token sequence after its last completed call."""

    tokens: tuple[int, ...]
    prompt_len: int
    segment: int
    turns: int
    chat: ChatState | None = None
    call_key: str = ""
    """The harness's idempotency key of the call that made it ("": none)."""
    before: Trajectory | None = None
    """The trajectory that call continued (its own ``before`` dropped): what a retry of
    the call continues."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A planned call: its prompt, and why it does not continue the trajectory (None: it
    does; "first": the execution's first call)."""

    token_ids: list[int]
    break_reason: str | None


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
    k = prev.chat.count
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
    k = chat.count
    if _digest(tools) != chat.tools:
        return "tools_changed"
    if len(messages) <= k or _digest(messages[:k]) != chat.messages:
        return "history_edited"
    reply = messages[k]
    if (
        reply["role"] != "assistant"
        or _digest(reply_key(reply["content"], reply.get("tool_calls", ()))) != chat.reply
    ):
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
    counters (turns that continued their execution's sequence, segment breaks by reason,
    trajectories resumed from the packer)."""

    def __init__(self) -> None:
        self._by_execution: dict[str, Trajectory] = {}
        self.turns = 0
        self.continued = 0
        self.retried = 0
        self.resumed = 0
        self.resume_failed = 0
        self.breaks: collections.Counter[str] = collections.Counter()

    def get(self, execution_id: str) -> Trajectory | None:
        return self._by_execution.get(execution_id)

    def base(self, execution_id: str, call_key: str = "") -> Trajectory | None:
        """The trajectory a new call continues: the execution's, or for a retry of the call
        that made it (the same idempotency key) the one that call continued."""
        traj = self._by_execution.get(execution_id)
        if traj is not None and call_key and traj.call_key == call_key:
            return traj.before
        return traj

    def install(self, execution_id: str, trajectory: Trajectory) -> None:
        """A trajectory resumed from the packer replaces what this router held."""
        self._by_execution[execution_id] = trajectory
        self.resumed += 1

    def record(
        self,
        execution_id: str,
        prompt: Sequence[int],
        output: Sequence[int],
        chat: ChatState | None = None,
        break_reason: str | None = None,
        call_key: str = "",
    ) -> Trajectory:
        """A call completed: its tokens become the execution's sequence. Whether it
        continued the sequence is decided on the tokens (the prompt extends the previous
        call's prompt + output), ``break_reason`` only names why not. A retry of the call
        that made the current trajectory replaces it."""
        prev = self._by_execution.get(execution_id)
        if prev is not None and call_key and prev.call_key == call_key:
            prev = prev.before
            self.retried += 1
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
            tuple(prompt) + tuple(output),
            len(prompt),
            segment,
            (prev.turns if prev else 0) + 1,
            chat,
            call_key,
            dataclasses.replace(prev, before=None) if prev is not None and prev.before is not None else prev,
        )
        self._by_execution[execution_id] = traj
        return traj

    def forget(self, execution_id: str) -> None:
        self._by_execution.pop(execution_id, None)

    def __len__(self) -> int:
        return len(self._by_execution)
