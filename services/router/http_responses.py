"""The HTTP API's answers in OpenAI's shapes: a call answered once as one JSON body, a
streamed one as server-sent events (a message per chunk; tool calls as deltas; the usage
event when asked for; ``data: [DONE]``), and errors as ``{"error": {"message", "type",
"code"}}`` with their HTTP status (a retryable one with ``Retry-After``).

A stream waits for its first chunk before it commits to 200, so a call that fails before
its first token gets a plain error status; a later failure is one SSE ``error`` event
followed by ``[DONE]``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gyre.errors import GyreError, http_status_for, retry_after_for
from gyre.tokens import Chunk, FinishReason
from services.router.calls import ModelCall
from services.router.toolcalls import ToolCallParser

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    503: "service_unavailable",
    504: "timeout",
}


async def unary_response(
    gen: AsyncIterator[Chunk], prompt: list[int], opts: dict[str, Any], chat: bool, model_name: str
) -> web.Response:
    """A call answered once: one JSON body (or the error it failed with)."""
    ids: list[int] = []
    logprobs: list[float] = []
    text = ""
    finish = None
    try:
        async for chunk in gen:
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            text += chunk.text
            finish = chunk.finish_reason or finish
    except GyreError as exc:
        return error_response(exc)
    parser: ToolCallParser | None = opts["parser"]
    parsed = opts.get("parsed")
    content, tool_calls = parsed or (parser.parse(text) if parser is not None else (text, []))
    reason = finish.openai if finish else None
    if tool_calls and finish is FinishReason.STOP:
        reason = "tool_calls"
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": reason,
        "stop_reason": opts["text"].stop_reason,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": content}
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    if opts["logprobs"]:
        choice["logprobs"] = {
            "content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]
        }
    if opts["token_ids"]:
        choice["token_ids"] = ids
    body = _envelope(chat, False, model_name)
    body["choices"] = [choice]
    body["usage"] = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }
    if opts["token_ids"]:
        body["prompt_token_ids"] = prompt
    body["gyre"] = {"reroutes": _reroutes(opts)}
    return web.json_response(body)


async def stream_response(
    request: web.Request,
    gen: AsyncIterator[Chunk],
    prompt: list[int],
    opts: dict[str, Any],
    chat: bool,
    model_name: str,
) -> web.StreamResponse:
    """A streamed call: server-sent events, a message per chunk, then ``[DONE]``."""
    # Wait for the first chunk before committing to 200, so an early failure is a 5xx.
    try:
        first: Chunk | None = await anext(gen)
    except StopAsyncIteration:
        first = None
    except GyreError as exc:
        return error_response(exc)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    envelope = _envelope(chat, True, model_name)
    parser: ToolCallParser | None = opts["parser"]
    completion = 0
    head = {**envelope, "prompt_token_ids": prompt} if opts["token_ids"] else envelope
    if chat:
        await _send(
            resp, head, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
        head = envelope
    try:
        chunk = first
        while chunk is not None:
            completion += len(chunk.token_ids)
            text = chunk.text
            if chunk.finish_reason is not None:
                # Complete the call first (its turn is recorded, the trajectory updated),
                # so a harness that acts on the finish reason finds it continued.
                await anext(gen, None)
            reason = chunk.finish_reason.openai if chunk.finish_reason else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
            if chat and parser is not None:
                content, calls = parser.stream(text, chunk.token_ids)
                if chunk.finish_reason is not None:
                    calls += parser.finish()
                    if parser.called and chunk.finish_reason is FinishReason.STOP:
                        choice["finish_reason"] = "tool_calls"
                delta: dict[str, Any] = {}
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                if not delta and chunk.finish_reason is None and not (opts["token_ids"] or opts["logprobs"]):
                    chunk = await anext(gen, None)
                    continue  # nothing to say yet (a tool call's JSON is forming)
                choice["delta"] = delta
            elif chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            if chunk.finish_reason is not None:
                choice["stop_reason"] = opts["text"].stop_reason
            if opts["token_ids"]:
                choice["token_ids"] = chunk.token_ids
            if opts["logprobs"]:
                choice["logprobs"] = {
                    "content": [
                        {"token_id": t, "logprob": lp}
                        for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)
                    ]
                }
            await _send(resp, head, choice)
            head = envelope
            chunk = await anext(gen, None) if chunk.finish_reason is None else None
        if opts["usage"]:
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            }
            await resp.write(_sse({**envelope, "choices": [], "usage": usage}))
    except GyreError as exc:
        status = http_status_for(exc)
        await resp.write(
            _sse(
                {
                    "error": {
                        "message": str(exc),
                        "type": _ERROR_TYPES.get(status, "server_error"),
                        "code": status,
                    }
                }
            )
        )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def error_response(exc: GyreError) -> web.Response:
    """The JSON error body; a retryable error (503) carries ``Retry-After`` (whole seconds)."""
    status = http_status_for(exc)
    hint = retry_after_for(exc)
    headers = {"Retry-After": str(max(1, math.ceil(hint)))} if hint is not None else None
    return web.json_response(
        {
            "error": {
                "message": str(exc) or type(exc).__name__,
                "type": _ERROR_TYPES.get(status, "server_error"),
                "code": status,
            }
        },
        status=status,
        headers=headers,
    )


def _envelope(chat: bool, stream: bool, model_name: str) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
    }


def _reroutes(opts: dict[str, Any]) -> int:
    box: list[ModelCall] = opts["box"]
    return box[0].reroutes if box else 0


async def _send(resp: web.StreamResponse, envelope: dict[str, Any], choice: dict[str, Any]) -> None:
    await resp.write(_sse({**envelope, "choices": [choice]}))


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
