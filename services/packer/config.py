"""The packer's typed configuration (section ``packer:`` of the cluster YAML)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from gyre.config import ServiceConfig
from gyre.staleness import StalenessSettings


class PackerConfig(ServiceConfig, StalenessSettings):
    """Settings of one packer process; frozen after start-up."""

    SECTION: ClassVar[str] = "packer"

    wal_dir: str = Field(".gyre/packer", description="Directory of the write-ahead log (created if missing).")
    wal_fsync: bool = Field(
        True, description="fsync each group commit of the WAL (off only for throwaway runs)."
    )
    wal_compact_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Compact the WAL to a snapshot once this many bytes were appended since the "
        "last compaction (checked every wal_compact_check_s).",
    )
    wal_compact_check_s: float = Field(5.0, gt=0, le=3600, description="How often the WAL size is checked.")
    batch_size: int = Field(4, ge=1, le=100_000, description="Groups per training batch.")
    micro_step_token_budget: int = Field(
        8192,
        ge=8,
        le=16_777_216,
        description="Most tokens (prompt + output) in one micro-step; a longer turn is refused.",
    )
    emit_fill_fraction: float = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description="A packed bin at least this full is emitted at once; emptier bins wait for "
        "more sequences until a claimer asks or the batch is sealed.",
    )
    max_group_size: int = Field(256, ge=1, le=65_536, description="Largest accepted group_size.")
    max_abs_reward: float = Field(
        1e9,
        gt=0,
        le=1e12,
        allow_inf_nan=False,
        description="A finish report whose |reward| exceeds this is INVALID_ARGUMENT, refused before "
        "anything is logged (group statistics of larger rewards overflow).",
    )
    failed_member_rule: Literal["drop_group", "keep_rest"] = Field(
        "drop_group",
        description="A group with a failed/timed-out/cancelled member: drop the whole group "
        "(reason failed_group), or drop only those members (failed_execution) and keep the rest.",
    )
    min_group_members: int = Field(
        2,
        ge=1,
        description="Under keep_rest: fewer completed members than this drops the group "
        "(failed_group); a group-relative advantage needs at least two.",
    )
    drop_zero_variance: bool = Field(
        True, description="Drop groups whose rewards are all equal (every advantage would be 0)."
    )
    advantage_std_normalize: bool = Field(
        True, description="Divide (reward - group mean) by the group's std (GRPO); off: Dr. GRPO."
    )
    advantage_eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    zero_variance_tol: float = Field(
        1e-9, ge=0, description="Reward std at or below this counts as zero variance."
    )
    claim_ttl_s: float = Field(
        10.0, gt=0, le=600, description="A claim not kept (KeepClaims/claim/ack) this long returns."
    )
    release_on_cell_loss: bool = Field(
        True,
        description="Return a cell's claims as soon as its etcd registration (keys.cell) vanishes, "
        "not only after claim_ttl_s.",
    )
    cell_loss_grace_s: float = Field(
        5.0,
        ge=0,
        description="How long a cell's registration must stay gone before its claims are released: "
        "an etcd outage past the lease TTL removes every registration, and live cells put theirs "
        "back within about a second of etcd's return.",
    )
    reap_interval_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="How often expired claims are returned to the pool (and, unless "
        "check_every_change, the conservation invariants are recounted).",
    )
    check_every_change: bool = Field(
        False,
        description="Recount the conservation invariants (produced = consumed + buffered + "
        "dropped, batch sizes) after every change instead of every reap_interval_s. The recount "
        "is O(groups + micro-steps): after every change it took a quarter of the claim path's "
        "CPU (bench/packer_claims.py). A broken invariant ends the process either way.",
    )
    max_claim_wait_s: float = Field(
        30.0, ge=0, le=30, description="Upper bound on ClaimMicroStepsRequest.wait_s."
    )
    max_buffered_turns: int = Field(
        1_000_000, ge=1, description="Turns held at most; RecordTurn beyond is RESOURCE_EXHAUSTED."
    )
    dedupe_batches: int = Field(
        8,
        ge=1,
        le=1_000_000,
        description="Retried turns and finish reports are answered as duplicates for groups resolved "
        "within the last this-many batches; older records are forgotten (bounded memory) and a retry "
        "that late is refused (FAILED_PRECONDITION).",
    )
    ready_grace_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="A group whose executions have all closed becomes ready this long after its "
        "last finish report, so that turn records still in the router's send queue get in.",
    )
    restart_grace_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="After a restart (a WAL with records replayed) no group becomes ready before "
        "this long has passed: while the packer was down, harnesses finished and the routers queued "
        "the turns of their last calls, and a turn that arrives after its group was made ready is "
        "refused (lost). Longer than the routers' RecordTurn back-off (router.turn_retry_max_s, 5 s) "
        "plus a reconnect (gRPC channels retry every 2 s at most).",
    )
    pre_encode: bool = Field(
        True,
        description="Encode each trajectory segment's wire form once, when its group becomes ready, "
        "and answer ClaimMicroSteps by concatenating those bytes (no proto built or serialized "
        "on the claim path; the answer parses to the same message). False: build the protos per claim.",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0: off).")
    wal_check_incarnation: bool = Field(
        True,
        description="Start a fresh WAL (archiving the old one) when etcd does not hold this WAL's "
        "id: the WAL belongs to an earlier cluster (e.g. a demo run with a new private etcd).",
    )
    policy_from_etcd: bool = Field(
        True, description="Mirror the policy version from etcd (keys.policy()) for staleness."
    )
