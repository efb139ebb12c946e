"""Tokenization in one place: the model directory's tokenizer and chat template (with the
request's tools), validation of OpenAI chat messages (tool calls and tool results included),
and incremental detokenization for streamed text.

Engines are token-in/token-out; because only the router turns text into tokens, a
continuation (prompt + tokens already generated) is exact at any engine. How a later turn's
prompt is built from the earlier one's tokens (never re-tokenizing generated text) is
:mod:`services.router.trajectory`'s business.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.errors import InvalidArgument

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class Tokenizer:
    """Wraps a local ``AutoTokenizer``. Methods are blocking; the ``a*`` variants run them
    off the event loop."""

    def __init__(self, hf: Any, name: str) -> None:
        self._hf = hf
        self.name = name
        self.vocab_size = len(hf)
        stops: list[int] = []
        for token in (hf.eos_token, "<|im_end|>", "<|endoftext|>"):
            if token is None:
                continue
            tid = hf.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid >= 0 and tid != hf.unk_token_id and tid not in stops:
                stops.append(tid)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self.has_chat_template = bool(getattr(hf, "chat_template", None))

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(hf, path.name)

    # Prompts -----------------------------------------------------------------------------

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Applies the chat template (with the assistant generation prompt) and tokenizes."""
        return self.encode(self.render(normalize_messages(messages), tools, add_generation_prompt=True))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        """The chat template applied to already normalized messages, as text."""
        if not self.has_chat_template:
            raise InvalidArgument("the served model has no chat template; use /v1/completions")
        try:
            return str(
                self._hf.apply_chat_template(
                    messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        except Exception as exc:  # jinja raises anything from TemplateError to TypeError
            raise InvalidArgument(f"the chat template cannot render these messages: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def hf(self) -> Any:
        """The wrapped ``transformers`` tokenizer (for vLLM's tool parsers)."""
        return self._hf

    async def aencode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.encode, text)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validates OpenAI chat messages: content parts flattened to text, an assistant's
    ``tool_calls`` kept with their arguments parsed (templates render them as JSON objects,
    as vLLM does), a tool result's ``tool_call_id`` kept."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidArgument(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(ROLES)}")
        content = _text_content(msg.get("content"), f"messages[{i}]")
        norm: dict[str, Any] = {"role": role, "content": content}
        calls = msg.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise InvalidArgument(f"messages[{i}]: only assistant messages carry tool_calls")
            norm["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id", "")
            if not isinstance(call_id, str):
                raise InvalidArgument(f"messages[{i}].tool_call_id must be a string")
            norm["tool_call_id"] = call_id
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidArgument(f"messages[{i}].name must be a string")
            norm["name"] = name
        out.append(norm)
    return out


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidArgument(f"{where}.content[{j}] must be a text part")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise InvalidArgument(f"{where}.content must be a string or a list of text parts")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidArgument(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(
                f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise InvalidArgument(f"{where}[{j}].function.arguments is not valid JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise InvalidArgument(f"{where}[{j}].function.arguments must be a JSON object")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidArgument(f"{where}[{j}].id must be a string")
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], bool]:
    """Validates ``tools`` and ``tool_choice``; returns (tools, parse tool calls?).

    ``tool_choice`` "auto" (the default with tools) and "none" are served. "required" and a
    named function need the engine to constrain its output (vLLM's guided decoding), which
    Gyre's token-level engines do not do: refused rather than silently not honoured."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgument("tool_choice needs tools")
        return [], False
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise InvalidArgument(
                f"tools[{j}] must be {{type: function, function: {{name, description, parameters}}}}"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"tools[{j}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise InvalidArgument(f"tools[{j}].function.parameters must be a JSON schema object")
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidArgument(f"tools[{j}].function.description must be a string")
        out.append({"type": "function", "function": fn})
    if tool_choice in (None, "auto"):
        return out, True
    if tool_choice == "none":
        return out, False
    raise InvalidArgument(
        "tool_choice 'required' or a named function needs guided decoding, which Gyre's engines do not do; "
        "use 'auto' (or 'none')"
    )


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back a partial UTF-8
    character until it is complete. Decodes a short window, not the whole output."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, ids: Sequence[int]) -> str:
        """Adds tokens; returns the new text they complete (may be empty)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
