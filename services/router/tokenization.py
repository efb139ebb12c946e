"""Tokenization in one place: the model directory's tokenizer and chat template, applied
once per model call, and incremental detokenization for streamed text.

Engines are token-in/token-out; because only the router turns text into tokens, a
continuation (prompt + tokens already generated) is exact at any engine.
"""

from __future__ import annotations

import asyncio
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

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Applies the chat template (with the assistant generation prompt) and tokenizes."""
        if not self.has_chat_template:
            raise InvalidArgument("the served model has no chat template; use /v1/completions")
        text = self._hf.apply_chat_template(
            normalize_messages(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=True))

    async def aencode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return await asyncio.to_thread(self.encode_chat, messages)

    async def aencode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.encode, text)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validates OpenAI chat messages and flattens content parts to text."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidArgument(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(ROLES)}")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}].content[{j}] must be a text part")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


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
