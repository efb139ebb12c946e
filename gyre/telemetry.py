"""Structured logs with the execution and cell ids, and OpenTelemetry tracing.

Logs are one JSON object a line (python-json-logger). The execution and cell ids come from
context variables, so every line logged while serving an execution carries them without
each call site passing them. Tracing is off by default; ``tracing: console`` or ``otlp``
turns it on (gRPC interceptors are added in :mod:`gyre.grpcx`, aiohttp in the router).
"""

from __future__ import annotations

import contextvars
import logging
import logging.handlers
import os
import sys
from typing import Any

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

execution_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("execution_id", default="")
cell_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("cell_id", default="")


class _ContextFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self._service
        if not getattr(record, "execution_id", ""):
            record.execution_id = execution_id_var.get()
        if not getattr(record, "cell_id", ""):
            record.cell_id = cell_id_var.get()
        return True


LOG_FILE_ENV = "GYRE_LOG_FILE"
"""Set by the launcher (apps/procs.py) to the file it sends a service's stderr to: the
service then rotates that file itself (``log_max_bytes``, ``log_keep``)."""


class StderrRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """The stdlib's size-rotating handler on the file this process's stderr goes to; after
    each rollover stderr (fd 2: tracebacks, warnings, faulthandler, what a library prints)
    follows to the new file, so nothing keeps writing to a rotated one."""

    def doRollover(self) -> None:
        super().doRollover()
        if self.stream is not None:
            sys.stderr.flush()
            os.dup2(self.stream.fileno(), 2)


def setup_logging(
    service: str, level: str = "INFO", json_lines: bool = True, max_bytes: int = 0, keep: int = 3
) -> None:
    """Configures the root logger for one service process: stderr, or, when the launcher
    names the file stderr goes to ($GYRE_LOG_FILE) and ``max_bytes`` > 0, that file rotated
    at ``max_bytes`` keeping ``keep`` rotated files (``<file>.1`` the newest)."""
    log_file = os.environ.get(LOG_FILE_ENV, "")
    handler: logging.Handler
    if log_file and max_bytes > 0:
        handler = StderrRotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=keep)
    else:
        handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(service)s %(name)s %(message)s %(execution_id)s %(cell_id)s",
                rename_fields={"asctime": "ts", "levelname": "level"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(service)s] %(message)s"))
    handler.addFilter(_ContextFilter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aetcd", "grpc", "asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def tag_execution(execution_id: str, **attributes: str | int) -> None:
    """Marks the work in progress as serving ``execution_id``: every log line from here on
    carries it, and so does the current trace span (``gyre.execution_id`` plus
    ``gyre.<key>`` for each extra attribute), so one execution can be followed from the
    harness through the router to the engine. Free when tracing is off."""
    execution_id_var.set(execution_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("gyre.execution_id", execution_id)
        for key, value in attributes.items():
            span.set_attribute(f"gyre.{key}", value)


def setup_tracing(service: str, exporter: str, otlp_endpoint: str = "") -> Any:
    """Installs a tracer provider; returns it (None when tracing is off)."""
    if exporter == "off":
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": f"gyre-{service}"}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True))
        )
    else:
        raise ValueError(f"tracing must be off, console or otlp, not {exporter!r}")
    trace.set_tracer_provider(provider)
    return provider
