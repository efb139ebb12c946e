"""The harness-facing OpenAI-compatible HTTP API on aiohttp: /v1/chat/completions and
/v1/completions (SSE streaming and not) and /v1/models.

Handler cancellation is on: a harness that disconnects cancels its handler, which closes
the model call and aborts the engine request. Bodies larger than ``max_body_bytes`` get
413, malformed JSON 400 (also a body nested deeper than ``MAX_JSON_DEPTH``, a string
holding a lone surrogate, a seed beyond int64 or a stop id beyond int32), an unknown token
401, another execution's token 403, a prompt that leaves no room in the model's context or
a trainable turn 400 (:mod:`services.router.limits`); none of them changes anything or
reaches an engine. Non-standard extensions: ``return_token_ids`` (token ids in every
choice), ``stop_token_ids``, and the headers ``x-gyre-execution-id`` (the execution the
token must hold) and ``x-gyre-timeout-s`` (the caller's deadline, propagated downstream).
The standard ``Idempotency-Key`` header names the model call: a harness that sends a call
again after its answer was lost (its router died) sends the same key, and the packer keeps
one turn for the call, the answer the harness got (up to 128 printable ASCII characters;
400 otherwise).

A chat call's prompt continues its execution's token sequence (see
:mod:`services.router.trajectory`); ``tools`` are rendered by the chat template and
generated tool calls come back as ``tool_calls`` (deltas when streaming), parsed by
:mod:`services.router.toolcalls`; ``stop`` strings of any length end a call as in vLLM
(:mod:`services.router.stops`), ``include_stop_str_in_output`` honoured.

What a request says is read and checked by this module's functions (:func:`parse_body`,
:func:`parse_sampling`, :func:`response_options`, :func:`request_timeout`); the answers,
JSON, SSE and errors, are written by :mod:`services.router.http_responses`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from gyre.errors import (
    GyreError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from gyre.ids import check_idempotency_key
from gyre.telemetry import tag_execution
from services.router.engine import Sampling
from services.router.http_responses import error_response, stream_response, unary_response
from services.router.limits import CallLimits
from services.router.manager import CallManager
from services.router.routes import Route
from services.router.stops import OutputText, parse_stop
from services.router.store import RouteStore
from services.router.tokenization import Tokenizer, normalize_messages, normalize_tools
from services.router.toolcalls import ToolCallParser, ToolCallParsers
from services.router.trajectory import ChatState, Prompt, Trajectory, chat_prompt

log = logging.getLogger(__name__)


class OpenAIApi:
    """Builds the aiohttp application; one instance per router process."""

    def __init__(
        self,
        *,
        manager: CallManager,
        tokenizer: Tokenizer,
        model_name: str,
        max_body_bytes: int,
        max_prompt_tokens: int,
        max_tokens_limit: int,
        default_max_tokens: int,
        request_timeout_s: float,
        store: RouteStore | None = None,
        tool_call_parser: str = "hermes",
        context_tokens: int = 0,
        turn_tokens: int = 0,
    ) -> None:
        self._manager = manager
        self._tools = ToolCallParsers(tool_call_parser, tokenizer)
        self._store = store
        self._tok = tokenizer
        self.model_name = model_name
        self._max_body_bytes = max_body_bytes
        self._limits = CallLimits(max_prompt_tokens, max_tokens_limit, context_tokens, turn_tokens)
        self._max_tokens_limit = max_tokens_limit
        self._default_max_tokens = default_max_tokens
        self._request_timeout_s = request_timeout_s

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # Endpoints ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "gyre"}],
            }
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    # The common path ---------------------------------------------------------------------

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            route = await self._authorize(request)  # 1. who (headers only: nothing read yet)
            tag_execution(route.execution_id, cell_id=route.cell_id)
            body = await self._read_json(request)  # 2. what (413 / 400)
            idempotency_key = check_idempotency_key(request.headers.get("Idempotency-Key", ""))
            timeout_s = request_timeout(request.headers.get("x-gyre-timeout-s"), self._request_timeout_s)
            prompt, sampling, opts = await self._parse(
                body, chat, route, idempotency_key, timeout_s
            )  # 3. validate, tokenize
        except GyreError as exc:
            return error_response(exc)
        gen = self._manager.generate(
            route,
            prompt,
            sampling,
            timeout_s,
            opts["box"],
            opts["text"],
            opts["break_reason"],
            whole=not opts["stream"],  # a JSON answer is written once: no wake per engine step
            idempotency_key=idempotency_key,
            chat_state=self._chat_state(opts),
        )
        async with contextlib.aclosing(gen):
            if opts["stream"]:
                return await stream_response(request, gen, prompt, opts, chat, self.model_name)
            return await unary_response(gen, prompt, opts, chat, self.model_name)

    async def _authorize(self, request: web.Request) -> Route:
        header = request.headers.get("Authorization", "")
        token = header[len("Bearer ") :].strip() if header.startswith("Bearer ") else ""
        execution_id = request.headers.get("x-gyre-execution-id") or None
        if not token:
            raise Unauthenticated("missing execution token (Authorization: Bearer <token>)")
        if self._store is not None:
            return await self._store.authorize(token, execution_id, peer=request.remote or "")
        return self._manager.routes.authorize(token, execution_id)

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise ResourceExhausted(f"request body larger than {self._max_body_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ResourceExhausted(f"request body larger than {self._max_body_bytes} bytes") from exc
        return parse_body(raw)

    async def _parse(
        self,
        body: dict[str, Any],
        chat: bool,
        route: Route,
        idempotency_key: str = "",
        timeout_s: float | None = None,
    ) -> tuple[list[int], Sampling, dict[str, Any]]:
        sampling, stop_strings, include_stop = parse_sampling(
            body,
            model_name=self.model_name,
            stop_token_ids=self._tok.stop_token_ids,
            default_max_tokens=self._default_max_tokens,
            max_tokens_limit=self._max_tokens_limit,
        )
        parser: ToolCallParser | None = None
        chat_input: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None
        break_reason = None
        if chat:
            messages = normalize_messages(body.get("messages"))
            tools, parse_tools = normalize_tools(body.get("tools"), body.get("tool_choice"))
            planned = await self._plan_chat(route.execution_id, idempotency_key, messages, tools, timeout_s)
            prompt, break_reason, chat_input = planned.token_ids, planned.break_reason, (messages, tools)
            if parse_tools:
                parser = await self._tools.new(tools, self.model_name)
        else:
            if body.get("tools"):
                raise InvalidArgument("tools need /v1/chat/completions")
            prompt = await self._completion_prompt(body.get("prompt"))
        sampling = self._limits.fit(len(prompt), sampling)
        opts = {
            **response_options(body),
            "box": [],
            "text": OutputText(self._tok, stop_strings, include_stop),
            "break_reason": break_reason,
            "parser": parser,
            "chat": chat_input,
            "execution_id": route.execution_id,
        }
        return prompt, sampling, opts

    async def _plan_chat(
        self,
        execution_id: str,
        idempotency_key: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        wait_s: float | None = None,
    ) -> Prompt:
        """The prompt of a chat call: continuing this router's trajectory of the execution
        when the history extends it and has no answer after it; else, when the history has
        answers, the packer's record of the execution's turns if that is later than this
        router's state or this one does not fit (another router served the calls since, or
        this one restarted); else rendered afresh. The packer is waited for (``wait_s`` at
        most, and the router's ``rebuild_wait_s``): a packer that does not answer fails the
        call UNAVAILABLE rather than continue an older state or render afresh, which a retry
        after a router died would not match its first try with."""
        tok = self._tok
        previous = self._manager.trajectories.base(execution_id, idempotency_key)
        planned = None
        if previous is not None:
            planned = await asyncio.to_thread(chat_prompt, tok, previous, messages, tools)
            if planned.break_reason is None and previous.chat is not None:
                if not _answered(messages, previous.chat.count + 1):
                    return planned  # the history ends with this router's state
        if _answered(messages, 0):
            resumed = await self._manager.resume(execution_id, idempotency_key, wait_s)
            local_ok = planned is not None and planned.break_reason is None
            # Any earlier state passes the history check; the packer's wins only when it is
            # later than this router's (or this router's does not fit at all).
            if resumed is not None and (not local_ok or _calls(resumed.trajectory) > _calls(previous)):
                again = await asyncio.to_thread(chat_prompt, tok, resumed.trajectory, messages, tools)
                if again.break_reason is None:
                    self._manager.adopt(execution_id, resumed)
                    return again
                planned = planned or again
        if planned is None:
            planned = await asyncio.to_thread(chat_prompt, tok, None, messages, tools)
        return planned

    @staticmethod
    def _chat_state(opts: dict[str, Any]) -> Callable[[str], ChatState] | None:
        """A chat call's state from its whole output text (the call manager asks once the call
        completed); its parse is kept for the answer (``opts["parsed"]``)."""
        if opts["chat"] is None:
            return None
        messages, tools = opts["chat"]
        parser: ToolCallParser | None = opts["parser"]

        def state(text: str) -> ChatState:
            content, calls = parser.parse(text) if parser is not None else (text, [])
            opts["parsed"] = (content, calls)
            return ChatState.of(messages, tools, content, calls)

        return state

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._tok.aencode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            if any(t < 0 or t >= self._tok.vocab_size for t in prompt):
                raise InvalidArgument(f"prompt token ids must be in [0, {self._tok.vocab_size})")
            return list(prompt)
        raise InvalidArgument("prompt must be a string or a non-empty list of token ids")


def _calls(trajectory: Trajectory | None) -> int:
    """How many messages the chat call that made ``trajectory`` had (-1: none, or token-level)."""
    return trajectory.chat.count if trajectory is not None and trajectory.chat is not None else -1


def _answered(messages: list[dict[str, Any]], start: int) -> bool:
    """Whether ``messages[start:]`` hold an assistant message (an answer of an earlier call)."""
    return any(m["role"] == "assistant" for m in messages[start:])


def request_timeout(raw: str | None, limit_s: float) -> float:
    """The call's deadline in seconds: ``x-gyre-timeout-s`` (``raw``), at most ``limit_s``,
    which is also the default."""
    if raw is None:
        return limit_s
    try:
        value = float(raw)
    except ValueError as exc:
        raise InvalidArgument("x-gyre-timeout-s must be a number of seconds") from exc
    if not value > 0 or not math.isfinite(value):
        raise InvalidArgument("x-gyre-timeout-s must be > 0")
    return min(value, limit_s)


def parse_sampling(
    body: dict[str, Any],
    *,
    model_name: str,
    stop_token_ids: Sequence[int],
    default_max_tokens: int,
    max_tokens_limit: int,
) -> tuple[Sampling, list[str], bool]:
    """A request's sampling (the model's ``stop_token_ids`` and the request's), its stop
    strings and ``include_stop_str_in_output``; its ``model`` (404 when another) and ``n``
    are checked first."""
    model = body.get("model")
    if model not in (None, "", model_name):
        raise NotFound(f"model {model!r} is not served here (serving {model_name!r})")
    if body.get("n", 1) != 1:
        raise InvalidArgument("only n=1 is supported")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else _int(max_tokens, "max_tokens")
    stops = list(stop_token_ids)
    extra_stops = body.get("stop_token_ids") or []
    if not isinstance(extra_stops, list):
        raise InvalidArgument("stop_token_ids must be a list of token ids")
    stops += [_int(t, "stop_token_ids[]") for t in extra_stops]
    stop_strings = parse_stop(body.get("stop"))
    include_stop = body.get("include_stop_str_in_output", False)
    if not isinstance(include_stop, bool):
        raise InvalidArgument("include_stop_str_in_output must be a boolean")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_float(body.get("temperature", 1.0), "temperature"),
        top_p=_float(body.get("top_p", 1.0), "top_p"),
        seed=_int(body.get("seed", 0) or 0, "seed"),
        stop_token_ids=tuple(dict.fromkeys(stops)),
    ).validate(max_tokens_limit)
    return sampling, stop_strings, include_stop


def response_options(body: dict[str, Any]) -> dict[str, Any]:
    """How the request wants its answer: ``stream``, and with token ids, log-probs, usage."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgument("stream must be a boolean")
    return {
        "stream": stream,
        "token_ids": bool(body.get("return_token_ids", False)),
        "logprobs": bool(body.get("logprobs", False)),
        "usage": bool((body.get("stream_options") or {}).get("include_usage", False))
        if isinstance(body.get("stream_options"), dict)
        else False,
    }


MAX_JSON_DEPTH = 64
"""Deepest nesting of a request body (a chat request needs about 6 levels)."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or InvalidArgument (never another exception)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidArgument(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    check_json(body)
    return body


def check_json(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuses (InvalidArgument) nesting deeper than ``max_depth`` and strings or keys that
    hold a lone surrogate (``"\\ud800"`` is valid JSON but no valid text: a tokenizer or an
    encoder would fail on it later, as a 500). Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict | list):
            if depth > max_depth:
                raise InvalidArgument(f"malformed JSON: nested deeper than {max_depth} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"a string holds a lone surrogate at position {exc.start}: not valid text"
        ) from exc


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number")
    return float(value)
