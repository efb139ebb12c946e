"""Tool calls in generated text, found by vLLM's tool-call parsers used as a library (the
parser named by ``RouterConfig.tool_call_parser``, e.g. ``hermes``: the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format Qwen models use).

vLLM (and with it torch) is imported on the first request that offers tools, in a worker
thread: seconds of start-up a router serving no tools never pays. A parser is stateful
while streaming, so every call gets its own instance.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from gyre.errors import InvalidArgument, Unavailable
from services.router.tokenization import Tokenizer


class ToolCallParsers:
    """Makes one parser per call; loads vLLM's parser class once."""

    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        self.name = name
        self._tok = tokenizer
        self._loading: asyncio.Future[Any] | None = None

    async def new(self, tools: list[dict[str, Any]], model: str) -> ToolCallParser:
        if not self.name:
            raise InvalidArgument("this router parses no tool calls (router.tool_call_parser is empty)")
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(_load, self.name))
        try:
            cls, request_type = await asyncio.shield(self._loading)
        except (ImportError, KeyError) as exc:
            raise Unavailable(f"tool-call parser {self.name!r} cannot be loaded: {exc}") from exc
        request = request_type(
            model=model or "gyre", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice="auto"
        )
        return ToolCallParser(cls(self._tok.hf, request.tools), request)


def _load(name: str) -> tuple[Any, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name), ChatCompletionRequest


class ToolCallParser:
    """One call's parser: the whole text at the end, or deltas while streaming."""

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser = parser
        self._request = request
        self._text = ""
        self._ids: list[int] = []
        self.called = False
        """True once a tool call was found (the finish reason becomes ``tool_calls``)."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a complete output, as OpenAI's message fields."""
        info = self._parser.extract_tool_calls(text, self._request)
        if not info.tools_called:
            return text, []
        calls = [
            {
                "id": call.id or _call_id(),
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in info.tool_calls
        ]
        self.called = bool(calls)
        return info.content, calls

    def stream(self, delta_text: str, delta_ids: list[int]) -> tuple[str | None, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the next piece of text."""
        prev_text, prev_ids = self._text, list(self._ids)
        self._text += delta_text
        self._ids.extend(delta_ids)
        if not delta_text:
            return None, []
        msg = self._parser.extract_tool_calls_streaming(
            prev_text, self._text, delta_text, prev_ids, list(self._ids), list(delta_ids), self._request
        )
        if msg is None:
            return None, []
        calls = [_delta_call(tc) for tc in msg.tool_calls or []]
        self.called = self.called or bool(calls)
        return msg.content, calls

    def finish(self) -> list[dict[str, Any]]:
        """Argument text parsed but not streamed yet (vLLM's serving layer sends it last)."""
        rest = self._parser.get_remaining_unstreamed_args() if self.called else ""
        if not rest:
            return []
        index = len(self._parser.prev_tool_call_arr) - 1
        return [{"index": index, "function": {"arguments": rest}}]


def _delta_call(tc: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": tc.index}
    if tc.id:
        out["id"] = tc.id
        out["type"] = "function"
    fn = tc.function
    if fn is not None:
        fn = fn if isinstance(fn, dict) else fn.model_dump(exclude_none=True)
        out["function"] = {k: v for k, v in fn.items() if v is not None}
    return out


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
