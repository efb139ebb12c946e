"""The cell agent's typed configuration (section ``cell_agent`` of the cluster YAML)."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from gyre.config import ServiceConfig
from services.cell_agent.training.config import TrainerSettings


class MockEngineSettings(BaseModel):
    """The mock engine (``engine: mock``): its timing model (defaults: 7B on an H200,
    docs/design/workloads.md), its batch, and scripted faults. ``cell_agent.mock`` in the YAML,
    ``GYRE_CELL_AGENT__MOCK__<FIELD>`` in the environment, ``--set mock.<field>=...``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    time_scale: float = Field(1.0, ge=0, description="Multiplier of every mock duration (0: no waiting).")
    fixed_decode_step_s: float = Field(
        0.0, ge=0, description="If > 0, each decode step costs this instead of the roofline term."
    )
    step_overhead_s: float = Field(0.003, ge=0, description="Fixed cost of every engine step.")
    n_params: float = Field(7.0e9, gt=0, description="Model parameters (compute terms).")
    weight_bytes: float = Field(14.0e9, ge=0, description="Bytes of weights read per decode step.")
    n_layers: int = Field(28, ge=1, description="Layers (prefill attention term).")
    d_model: int = Field(3584, ge=1, description="Hidden size (prefill attention term).")
    kv_bytes_per_token: float = Field(57344.0, ge=0, description="KV-cache bytes per context token.")
    hbm_bytes_per_s: float = Field(4.8e12, gt=0, description="Memory bandwidth, bytes/s.")
    flops: float = Field(989e12, gt=0, description="Dense bf16 FLOP/s.")
    weight_load_s: float = Field(0.1, ge=0, description="Cost of an in-place weight update.")
    sleep_s: float = Field(0.5, ge=0, description="Cost of releasing rollout memory (sleep).")
    wake_s: float = Field(0.5, ge=0, description="Cost of restoring rollout memory (wake).")
    vocab_size: int = Field(512, ge=8, description="Mock token ids are drawn from [3, vocab).")
    max_batch: int = Field(256, ge=1, description="Most requests the mock runs in one step.")
    kv_dir: str = Field("", description="Directory for exported KV handles (file medium); memory if empty.")
    die_after_tokens: int = Field(-1, ge=-1, description="Fault: the mock dies after this many tokens.")
    hang_after_tokens: int = Field(-1, ge=-1, description="Fault: the mock hangs after this many tokens.")

    def timing(self) -> dict[str, Any]:
        """The :class:`~services.cell_agent.engines.mock.MockTiming` fields."""
        return {name: getattr(self, name) for name in TIMING_FIELDS}


TIMING_FIELDS = (
    "n_params",
    "weight_bytes",
    "n_layers",
    "d_model",
    "kv_bytes_per_token",
    "hbm_bytes_per_s",
    "flops",
    "step_overhead_s",
    "fixed_decode_step_s",
    "weight_load_s",
    "sleep_s",
    "wake_s",
    "time_scale",
)


class CellAgentConfig(ServiceConfig):
    """One cell: its identity, its engine, and the crash-only health probe."""

    SECTION: ClassVar[str] = "cell_agent"
    MOVED_SECTIONS: ClassVar[dict[str, str]] = {"training": "cell_agent.training"}

    # Identity -------------------------------------------------------------------------------
    cell_id: str = Field(
        "cell-0",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Unique cell id; the key of its registration in etcd.",
    )
    kind: Literal["standalone", "elastic"] = Field(
        "elastic", description="standalone cells always serve; elastic cells also train."
    )
    index: int = Field(0, ge=-1, description="Elastic index (0 = core, 1.. satellites); -1 for standalone.")
    slots: int = Field(8, ge=1, le=4096, description="Concurrent executions the engine serves in rollout.")

    # Engine ---------------------------------------------------------------------------------
    engine: Literal["mock", "vllm"] = Field("mock", description="Engine implementation.")
    model_dir: str = Field(
        "", description="Local model directory (required for vllm; mock hashes its weights)."
    )
    policy_version: int = Field(0, ge=0, description="Policy version the initial weights are served as.")
    max_model_len: int = Field(4096, ge=16, description="vLLM: longest context (prompt + output) in tokens.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM: most sequences in one batch.")
    dtype: str = Field("bfloat16", description="vLLM: weight dtype.")
    seed: int = Field(
        0,
        ge=0,
        description="Engine sampling seed: what a sampled request without a seed of its own "
        "draws from (vLLM's global seed; the mock's salt for such requests). 0 (the default): "
        "derived from cell_id (engine_seed: a stable hash, in 1..2**31-1), so that cells do "
        "not all sample one stream; set it per cell to pin one. A request's own seed "
        "(the router gives every sampled call one) is used as is: a rerouted call's "
        "continuation keeps its stream.",
    )
    gpu_memory_utilization: float = Field(0.8, gt=0, le=1, description="vLLM on GPU: memory fraction.")
    kv_handoff: bool = Field(
        True,
        description="vLLM: pin, serve and read KV blocks for handoffs engine to engine "
        "(off: ExportKv answers nothing and a moved call recomputes its prefix).",
    )
    kv_medium: Literal["", "tcp", "nccl", "cuda_ipc"] = Field(
        "",
        description="vLLM: how KV blocks travel: tcp (CPU, any hosts), nccl (GPUs, point to "
        "point), cuda_ipc (GPUs on one node); empty: tcp (the GPU mediums are opt-in until "
        "tests/gpu/test_kv_transfer.py has run on a GPU machine).",
    )
    kv_host: str = Field(
        "127.0.0.1",
        description="vLLM: address the engine serves pinned KV blocks on (an address "
        "other cells reach when handoffs cross hosts).",
    )
    kv_pin_ttl_s: float = Field(
        30.0,
        gt=0,
        description="A KV handle (vLLM: its pinned blocks; the mock: its copy) not imported or released within "
        "this is dropped.",
    )
    kv_read_timeout_s: float = Field(
        10.0, gt=0, description="vLLM: deadline of a destination's read; past it the prefix is recomputed."
    )
    kv_dir: str = Field(
        "", description="Mock engine: directory for exported KV handles (file medium); memory if empty."
    )
    max_prompt_tokens: int = Field(131072, ge=1, description="Longest prompt Generate accepts.")
    max_tokens_limit: int = Field(65536, ge=1, description="Largest max_tokens Generate accepts.")

    mock: MockEngineSettings = Field(
        default_factory=MockEngineSettings, description="The mock engine's timing model and faults."
    )

    # Lifecycle and health -----------------------------------------------------------------------
    drain_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long SetState(TRAINING) waits for the engine to hold no request "
        "before refusing (keep it under the scheduler's command deadline).",
    )
    probe_interval_s: float = Field(2.0, gt=0, description="Health probe period (a probe generates a token).")
    probe_timeout_s: float = Field(10.0, gt=0, description="A probe slower than this means the engine hung.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0: off).")
    pid_dir: str = Field(
        "",
        description="Where the cell records the processes it started, so its next incarnation "
        "ends what a crash left running (services/cell_agent/incarnation.py); empty: "
        "$XDG_RUNTIME_DIR/gyre/<cluster> or <tmp>/gyre-<uid>/<cluster>.",
    )
    snapshot_timeout_s: float = Field(120.0, gt=0, description="Deadline of a LoadPolicy weight pull.")

    # Training ------------------------------------------------------------------------------------
    training: TrainerSettings | None = Field(
        None,
        description="How this cell trains (services/cell_agent/training/config.py): mode torch "
        "(the real trainer) or mock (the cost model); absent: this cluster does not train.",
    )

    @property
    def engine_seed(self) -> int:
        """The engine's sampling seed: ``seed``, or when it is 0 a stable hash of the cell id."""
        return self.seed or cell_seed(self.cell_id)


def cell_seed(cell_id: str) -> int:
    """A cell's own engine seed: a stable hash of its id (the same in every process and
    incarnation, unlike ``hash``), in 1..2**31-1 (vLLM seeds numpy with it: < 2**32)."""
    h = hashlib.blake2b(f"gyre-cell-seed\0{cell_id}".encode(), digest_size=8)
    return 1 + int.from_bytes(h.digest(), "little") % (2**31 - 1)
