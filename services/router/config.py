"""The router's typed configuration (section ``router`` of the cluster YAML)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from gyre.config import ServiceConfig


class RouterConfig(ServiceConfig):
    """Settings of one router process; frozen after start-up."""

    SECTION: ClassVar[str] = "router"

    http_port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP API (0 picks a free one).",
    )
    model_dir: str = Field(
        "",
        description="Local model directory holding the tokenizer and its chat template.",
    )
    served_model_name: str = Field(
        "",
        description="Model name served on /v1/models; defaults to the model directory's name.",
    )
    packer_target: str = Field(
        "",
        description="gRPC target of the packer (turn records); empty disables turn records.",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Largest HTTP request body; larger gets 413.",
    )
    max_prompt_tokens: int = Field(131072, ge=1, description="Largest prompt (in tokens) of one model call.")
    max_tokens_limit: int = Field(32768, ge=1, description="Largest max_tokens a call may ask for.")
    max_model_len: int = Field(
        0,
        ge=0,
        description="The served model's context (prompt + output tokens), as the engines' "
        "cell_agent.max_model_len: a prompt that leaves no room is 400 / INVALID_ARGUMENT before any "
        "engine sees it, and max_tokens is cut to the room left. 0: the model's max_position_embeddings "
        "(model_dir/config.json), if any.",
    )
    max_turn_tokens: int = Field(
        0,
        ge=0,
        description="The packer's micro_step_token_budget: no call grows a turn past it (max_tokens is "
        "cut; a prompt that fills it is 400), so every turn recorded can be trained. 0: the model's "
        "context (max_model_len, else max_position_embeddings), else 8192 (the packer's default budget).",
    )
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens when an HTTP request gives none.")
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Deadline of one HTTP model call and of one call on a Router.GenerateStream (Generate "
            "calls use the caller's deadline, capped by this)."
        ),
    )
    max_stream_calls: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="Calls one Router.GenerateStream may have in flight; a call beyond is answered "
        "RESOURCE_EXHAUSTED.",
    )
    retry_budget: int = Field(
        2,
        ge=0,
        le=100,
        description=(
            "Engine failures one call survives (continuations at the same or a new route); moves by "
            "the scheduler do not count."
        ),
    )
    failover_wait_s: float = Field(
        12.0,
        ge=0,
        description=(
            "After an engine failure, how long the call is held open for the scheduler to move the "
            "route before retrying at the current one. The router reports the failure, so a dead "
            "engine's routes move within about a second; this covers the case where no report gets "
            "through (the move then comes when the cell's lease lapses). A scheduler answer that "
            "the engine lives ends the wait at once."
        ),
    )
    report_engine_failures: bool = Field(
        True,
        description="Report engine failures to the scheduler leader (SchedulerControl.ReportEngineFailure).",
    )
    engine_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "An engine stream with no chunk for this long counts as a failed engine (a hang is "
            "never forwarded)."
        ),
    )
    engine_stream: bool = Field(
        True,
        description=(
            "True: every request this router has on one engine shares one long-lived "
            "Engine.GenerateStream (starts and cancels in, each engine step's tokens of all of them "
            "out, in columns: no gRPC message per token per request). False: one Engine.Generate "
            "call per request (the older path, for engines without GenerateStream)."
        ),
    )
    abort_timeout_s: float = Field(0.5, gt=0, description="Deadline of Engine.Abort calls.")
    kv_handoff: bool = Field(
        False,
        description="On a scheduler move, export the source's KV blocks and import them at the destination.",
    )
    kv_timeout_s: float = Field(
        1.0,
        gt=0,
        description="Deadline of ExportKv; past it the destination recomputes the prefix.",
    )
    route_resync_s: float = Field(
        10.0,
        gt=0,
        description="Period of the route table's full relist (watches are hints).",
    )
    unknown_token_wait_s: float = Field(
        5.0,
        ge=0,
        description="How long a call with a token the router does not know waits for its route to arrive "
        "through the watch (a fresh execution's first call can beat the watch); never an etcd read. "
        "(1 s lost an episode in a vLLM demo: the watch lagged past it on a busy router.)",
    )
    unknown_token_rate_per_s: float = Field(
        20.0,
        ge=0,
        description="Unknown-token calls per second per peer address before RESOURCE_EXHAUSTED / 429.",
    )
    unknown_token_burst: int = Field(40, ge=1, description="Burst of the unknown-token rate.")
    move_route_wait_s: float = Field(
        2.0,
        gt=0,
        description="How long MoveExecutions waits for a route at the announced epoch.",
    )
    turn_buffer: int = Field(
        10000,
        ge=1,
        description="Turn records buffered for the packer before the oldest are dropped.",
    )
    turn_record_wait_s: float = Field(
        30.0,
        ge=0,
        le=600,
        description="A completed call ends for the harness once the packer holds its turn, waiting "
        "at most this long (the record goes on in the background past it; 0: never wait). The harness "
        "reports a finish after its last call, so its group cannot become ready without the turn. Long "
        "enough to outlast a packer restart: a turn that reaches the packer after its group's finish "
        "report is refused, and lost.",
    )
    rebuild_wait_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="How long a chat call waits for the packer to say where its execution stands "
        "(GetTrajectory) when this router does not hold the execution's token sequence (it restarted, or "
        "the harness's calls moved here), retrying while the packer is unreachable; past it (or the "
        "call's own deadline) the call fails UNAVAILABLE and the harness retries it. A prompt built "
        "without that answer would not be the one its first try had: the packer refuses such a retry.",
    )
    turn_senders: int = Field(
        32,
        ge=1,
        le=64,
        description="Concurrent RecordTurn calls (the packer makes concurrent records durable with one "
        "fsync: more senders keep the records up with the calls under load).",
    )
    coalesce_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description=(
            "Hold each streamed harness-side message after the first up to this long to merge "
            "more tokens into it (0: forward every engine chunk as soon as it arrives; queued "
            "chunks are merged anyway). 10 by measurement: docs/benchmarks/router.md."
        ),
    )
    tool_call_parser: str = Field(
        "hermes",
        description=(
            "vLLM tool-call parser (used as a library) that turns generated text into OpenAI "
            "tool_calls for requests with tools, e.g. hermes (Qwen2.5 / the tiny model); empty: "
            "requests with tools are refused. vLLM is imported on the first such request."
        ),
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0: off).")
    turn_retry_max_s: float = Field(5.0, gt=0, description="Largest back-off between RecordTurn retries.")
