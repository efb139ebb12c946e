"""Typed settings of a cell's trainer: ``cell_agent.training`` in the cluster YAML,
``GYRE_CELL_AGENT__TRAINING__<FIELD>`` in the environment, ``--set training.<field>=...`` on
the command line, validated like every other setting.

``mode`` picks the trainer: ``torch`` (:class:`TrainingSettings`, the real trainer) or
``mock`` (:class:`MockTrainerSettings`, the cost-model trainer of the emulated cluster).
No section (``None``) means this cluster does not train.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class TrainingSettings(BaseModel):
    """How a cell trains: model, loss, optimizer, collectives, snapshots, checkpoints.

    The cell agent embeds it as ``cell_agent.training`` (YAML) /
    ``GYRE_CELL_AGENT__TRAINING__<FIELD>`` (env)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["torch"] = Field("torch", description='"torch": the real trainer (this section).')
    enabled: bool = Field(
        True, description="Train on this cell (elastic cells only). Off: JoinBatch answers joined=false."
    )
    model_dir: str = Field(
        "", description="Local directory of the causal LM (transformers layout); empty: the cell's model_dir."
    )
    dtype: str = Field(
        "float32",
        pattern="^(float32|float64|bfloat16)$",
        description="Dtype of the trained (master) weights and gradients.",
    )
    device: str = Field(
        "auto", description='"auto" (cuda:<local> when CUDA is up, else cpu), "cpu" or "cuda:N".'
    )
    initial_policy_version: int = Field(
        0, ge=0, description="Version of the weights loaded from model_dir (the cluster starts at 0)."
    )
    pipeline_stages: int = Field(
        1,
        ge=1,
        le=64,
        description="Devices (stages) of this cell: above 1 the model is cut by layer into that many "
        "stages, one worker process each, trained by a 1F1B pipeline (services/cell_agent/training/"
        "stages.py); the agent keeps the master weights and the optimizer on the host.",
    )
    pipeline_threads: int = Field(1, ge=1, le=256, description="CPU threads of each stage worker.")
    # Loss (token-level PPO-clip / GRPO; services/cell_agent/training/trainer.py).
    objective: Literal["decoupled", "coupled"] = Field(
        "decoupled",
        description="decoupled: clip against the proximal policy (the batch's weights) and weight each "
        "token by pi_prox/pi_behaviour (AReaL), for asynchronous training; coupled: standard PPO, the "
        "ratio clipped against the engine's log-probs (learns little from stale data).",
    )
    behaviour_weight_cap: float = Field(
        5.0, gt=1, description="decoupled: tokens whose pi_prox/pi_behaviour exceeds this are masked out."
    )
    clip_eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip of the importance ratio: 1 - eps.")
    clip_eps_high: float = Field(0.2, ge=0, le=10, description="Upper clip of the importance ratio: 1 + eps.")
    # Optimizer (AdamW on the core only).
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip after normalization.")
    # Collectives: one process group over every elastic cell, a subgroup per prefix.
    world_size: int = Field(1, ge=1, le=1024, description="Number of elastic cells (core + satellites).")
    dist_master: str = Field("127.0.0.1:29500", description="host:port of the core's rendezvous store.")
    dist_backend: str = Field(
        "auto", pattern="^(auto|gloo|nccl)$", description="auto: nccl on CUDA, else gloo."
    )
    dist_timeout_s: float = Field(600.0, gt=0, description="Timeout of each collective.")
    dist_form_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Timeout of one formation of the prefix groups (every elastic cell's "
        "rendezvous and connections); a formation that fails is tried again with back-off.",
    )
    join_wait_s: float = Field(
        10.0, ge=0, description="How long a satellite waits for its predecessor to join."
    )
    # Streaming claims.
    claim_wait_s: float = Field(
        1.0, ge=0, le=30, description="Long-poll of one ClaimMicroSteps call when data pauses."
    )
    claim_batch: int = Field(
        4,
        ge=1,
        le=64,
        description="Micro-steps claimed per ClaimMicroSteps call and acked together in one "
        "AckMicroSteps call (a cell holds at most twice this many while it trains).",
    )
    packer_target: str = Field("", description="gRPC target of the packer.")
    # Snapshots and checkpoints.
    snapshot_keep: int = Field(2, ge=1, le=16, description="Snapshot versions the core keeps for pulls.")
    snapshot_chunk_bytes: int = Field(
        1 << 20, ge=4096, le=4 << 20, description="Chunk size of snapshot pulls."
    )
    pull_timeout_s: float = Field(300.0, gt=0, description="Deadline of one snapshot pull.")
    checkpoint_dir: str = Field("", description="Where the core writes a checkpoint per step; empty: none.")
    checkpoint_keep: int = Field(2, ge=1, le=100, description="Checkpoints kept on disk.")
    keep_versions_every: int = Field(
        0,
        ge=0,
        description="The core also keeps the weights of every N-th version (and the last) under "
        "checkpoint_dir/versions/ for evaluation; 0: none.",
    )
    tensorboard_dir: str = Field(
        "", description="The core writes TensorBoard event files here (a scalar set per step); empty: none."
    )


class MockTrainerSettings(BaseModel):
    """``mode: mock``: the cost-model trainer (``sim.config.CostConfig``'s training terms),
    used by the emulated cluster (``sim/emulate.py``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["mock"] = Field("mock", description='"mock": the cost-model trainer.')
    enabled: bool = Field(True, description="Train on this cell (elastic cells only).")
    packer_target: str = Field("", description="gRPC target of the packer.")
    time_scale: float = Field(1.0, ge=0, description="Multiplier of every modelled duration (0: no waiting).")
    n_params: float = Field(7.6e9, gt=0, description="Model parameters N (6N FLOPs per trained token).")
    flops: float = Field(989e12, gt=0, description="Dense FLOP/s per GPU.")
    train_flops_eff: float = Field(0.35, gt=0, le=1, description="Achieved FLOP fraction (MFU) in training.")
    gpus_per_cell: int = Field(1, ge=1, description="GPUs in one cell.")
    train_step_fixed_s: float = Field(2.0, ge=0, description="Fixed cost of one optimizer update (core).")
    weight_sync_s: float = Field(0.1, ge=0, description="A satellite pulling the batch's weights.")
    claim_wait_s: float = Field(1.0, ge=0, le=30, description="Long-poll of one ClaimMicroSteps call.")
    claim_batch: int = Field(
        4, ge=1, le=64, description="Micro-steps claimed per ClaimMicroSteps call, acked together."
    )
    join_wait_s: float = Field(10.0, ge=0, description="How long a join waits for the previous batch to end.")
    done_poll_s: float = Field(0.05, gt=0, description="Core: GetBatch poll period while waiting for acks.")
    initial_policy_version: int = Field(0, ge=0, description="Version the cluster starts at.")
    segment_marker_id: int = Field(
        2,
        ge=-1,
        description="Token id that opens each turn's new prompt segment (the emulation's "
        "replay driver writes it; engines never emit it): a sequence then counts only the tokens "
        "from its last marker on, so an episode's turns together count its final context, as in "
        "sim. -1: count every token of every packed sequence (what a real trainer processes).",
    )

    def micro_step_s(self, tokens: int) -> float:
        """Scaled seconds to train ``tokens`` tokens on one cell."""
        rate = self.gpus_per_cell * self.flops * self.train_flops_eff / (6.0 * self.n_params)
        return tokens / rate * self.time_scale


def _mode(value: Any) -> str:
    """The trainer a ``training`` section selects (``torch`` unless it says ``mode: mock``)."""
    mode = value.get("mode", "torch") if isinstance(value, dict) else getattr(value, "mode", "torch")
    return str(mode)


TrainerSettings = Annotated[
    Annotated[TrainingSettings, Tag("torch")] | Annotated[MockTrainerSettings, Tag("mock")],
    Discriminator(_mode),
]
"""The ``cell_agent.training`` section: the real trainer's or the mock trainer's settings."""
