"""Typed configuration: one pydantic model per service, from a YAML file with environment
overrides, frozen after start-up.

A cluster config file has one section per service plus ``cluster`` (shared settings)::

    cluster: {name: demo, etcd_endpoints: ["127.0.0.1:23790"]}
    scheduler: {port: 50051, batch_size: 4}

A service reads ``cluster`` merged with its own section. Environment variables override
both: ``GYRE_<SECTION>__<FIELD>`` (e.g. ``GYRE_SCHEDULER__BATCH_SIZE=8``), nested fields
with another ``__``. pydantic-settings does the parsing and validation; this module only
orders the sources (env over file over defaults).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

T = TypeVar("T", bound="ServiceConfig")

CONFIG_ENV = "GYRE_CONFIG"
"""Environment variable naming the config file when ``--config`` is not given."""


class TlsConfig(BaseModel):
    """Mutual TLS of this process: its gRPC server, its gRPC clients and its etcd client.

    On by default: a process without a certificate refuses to start. The files follow the
    cert-manager layout of a ``kubernetes.io/tls`` Secret (``tls.crt``, ``tls.key``,
    ``ca.crt``), which ``python -m gyre.certs`` also writes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    insecure: bool = Field(
        False,
        description="Plaintext, no identities, every RPC admitted: an explicit opt-out for "
        "local debugging, logged as a warning.",
    )
    dir: str = Field(
        "",
        description="Identity directory holding tls.crt, tls.key and ca.crt; '{identity}' stands for "
        "this process's identity name (scheduler, router, packer, dashboard, or the cell id).",
    )
    cert_file: str = Field("", description="PEM certificate of this process (overrides dir/tls.crt).")
    key_file: str = Field("", description="PEM private key of this process (overrides dir/tls.key).")
    ca_file: str = Field("", description="PEM CA bundle peers are checked against (overrides dir/ca.crt).")


class ServiceConfig(BaseSettings):
    """Settings every service shares. Subclasses add their own fields and set ``SECTION``."""

    SECTION: ClassVar[str] = "service"
    MOVED_SECTIONS: ClassVar[dict[str, str]] = {}
    """Top-level sections this service used to read, and where they live now (a file that
    still has one is refused with that message instead of being silently ignored)."""

    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", env_nested_delimiter="__", case_sensitive=False
    )

    cluster_name: str = Field("gyre", description="Prefix of every etcd key: /gyre/<cluster_name>/.")
    etcd_endpoints: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:23790"], description="etcd client endpoints, host:port."
    )
    etcd_timeout_s: float = Field(5.0, gt=0, description="Deadline of each etcd call.")
    etcd_start_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a starting process retries while etcd does not answer (connect and "
        "lease grant) before it gives up: an etcd outage or restart while a service starts or "
        "restarts delays the start instead of ending the process.",
    )
    lease_ttl_s: int = Field(
        10,
        ge=2,
        le=60,
        description="TTL of this process's etcd lease: how long a stalled or dead process keeps its "
        "registrations, claims and leadership. 10 s survives CPU starvation on a 2-core machine.",
    )
    host: str = Field("127.0.0.1", description="Address to bind; loopback unless configured.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0 picks a free one).")
    advertise_host: str = Field(
        "", description="Host other services use to reach this one; defaults to `host`."
    )
    max_message_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted or sent."
    )
    grace_s: float = Field(5.0, ge=0, description="Drain period on shutdown before cancelling.")
    rpc_timeout_s: float = Field(10.0, gt=0, description="Default deadline of outgoing unary calls.")
    log_level: str = Field("INFO", description="Python logging level.")
    log_json: bool = Field(True, description="Structured JSON logs (one object a line).")
    history_file: str = Field("", description="Append operations as JSONL here (checker input).")
    history_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Rotate the history file once it reaches this size: it becomes "
        "`<history_file>.<n>` (n = 1, 2, ...; the lowest is the oldest) and a new file starts. "
        "0: never rotate. The checker reads every segment.",
    )
    history_keep: int = Field(
        0,
        ge=0,
        description="Rotated history segments kept, the newest (older ones are deleted); 0: all. "
        "The checker needs a whole history to verify a run: with segments deleted it checks what "
        "is left and says so (`pruned` in its verdict), and can report violations whose first "
        "half was deleted.",
    )
    log_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Rotate this service's log file (the one the launcher sends its stderr to, "
        "named by $GYRE_LOG_FILE) once it reaches this size: `<log>.1` is the newest rotated "
        "file (logging.handlers.RotatingFileHandler). 0: never rotate.",
    )
    log_keep: int = Field(
        3, ge=1, description="Rotated log files kept (`<log>.1` .. `<log>.<log_keep>`), when rotating."
    )
    tracing: str = Field("off", description='OpenTelemetry exporter: "off", "console" or "otlp".')
    otlp_endpoint: str = Field("127.0.0.1:4317", description="OTLP gRPC collector, if tracing=otlp.")
    tls: TlsConfig = Field(default_factory=TlsConfig, description="Mutual TLS (on by default).")
    gc_freeze: bool = Field(
        True,
        description="Once started, move the start-up heap (modules, tokenizer, config) out of the "
        "garbage collector's generations (gc.freeze, as vLLM's engine does): full collections then "
        "scan only what was allocated since. Measured on the router: CPU per relayed token "
        "about halved (docs/benchmarks/router.md).",
    )
    heap_profile_s: float = Field(
        0.0,
        ge=0,
        description="Every this many seconds, log the Python heap's growth since the first interval by "
        "allocation site (tracemalloc: for finding what grows in a long run; it costs memory and CPU). "
        "Tracing starts once the service is ready: the router's first tokenizer load took 391 s traced "
        "(18 s untraced). 0: off.",
    )
    heap_trim_s: float = Field(
        300.0,
        ge=0,
        description="Every this many seconds, hand the heap's free pages back to the system (glibc's "
        "malloc_trim; gyre/heap.py): freed C memory (gRPC's, torch's) otherwise stays with the "
        "allocator's arenas and reads as growth. 0: never (a trainer still trims after each batch).",
    )
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Plaintext port serving only grpc.health.v1 (Kubernetes' gRPC probes cannot "
        "do TLS); 0: none. Health is also served on the main (mTLS) port.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (passed as init kwargs), which beats the defaults.
        return (env_settings, init_settings)

    def identity_name(self) -> str:
        """This process's identity name (what ``{identity}`` in ``tls.dir`` stands for):
        the service's role, or a cell agent's cell id; "" for a config of no service."""
        from gyre.identity import SERVICE_ROLES, service_identity

        if self.SECTION not in SERVICE_ROLES:
            return ""
        return service_identity(self.SECTION, str(getattr(self, "cell_id", ""))).name


def read_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The raw YAML mapping of a config file ({} for no file)."""
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return data


def load(cls: type[T], path: str | os.PathLike[str] | None = None, **overrides: Any) -> T:
    """Builds ``cls`` from the ``cluster`` and ``cls.SECTION`` sections of ``path`` (or
    $GYRE_CONFIG), environment variables ``GYRE_<SECTION>__*``, and ``overrides`` (a key
    "a.b" overrides field ``b`` of the nested section ``a``)."""
    data = read_file(path or os.environ.get(CONFIG_ENV))
    section = cls.SECTION
    for old, new in cls.MOVED_SECTIONS.items():
        if old in data:
            raise ValueError(
                f"{path or os.environ.get(CONFIG_ENV)}: the top-level '{old}:' section is now '{new}'; move it there"
            )
    merged: dict[str, Any] = {}
    merged.update(_shared_fields(cls, data.get("cluster") or {}))
    merged.update(data.get(section) or {})
    for key, value in overrides.items():
        set_dotted(merged, key, value)
    env_prefix = f"GYRE_{section.upper()}__"

    class _Bound(cls):  # type: ignore[valid-type,misc]
        model_config = SettingsConfigDict(env_prefix=env_prefix)

    _Bound.__name__ = cls.__name__
    built = _Bound(**merged)
    return cls.model_validate(built.model_dump())


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` arguments as overrides: a VALUE that parses as JSON is that
    (numbers, booleans, lists), anything else the string itself."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b] = value`` for ``key`` "a.b" (``--set training.lr=0.1``): a nested
    override keeps the section's other fields; a non-mapping in the way is replaced."""
    *path, leaf = key.split(".")
    node = data
    for part in path:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
        node[part] = child = dict(child)
        node = child
    node[leaf] = value


def _shared_fields(cls: type[ServiceConfig], cluster: dict[str, Any]) -> dict[str, Any]:
    out = dict(cluster)
    if "name" in out:
        out["cluster_name"] = out.pop("name")
    return {k: v for k, v in out.items() if k in cls.model_fields}
