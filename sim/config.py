"""Simulator configuration: workload profiles, drift, the GPU cost model, the cluster and the
scenarios, as pydantic models read from one YAML file with dotted ``--set`` overrides.

Every number the simulator uses lives here (defaults follow docs/design/workloads.md); nothing is
hard-coded in the engine. ``load_config(path, overrides)`` is the one entry point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.scheduler.config import GyreSettings, StaleRuleSettings


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LogNormal(_Frozen):
    """LN(median, sigma): a lognormal with median ``median`` and log-sd ``sigma``, clipped."""

    median: float = Field(..., gt=0, description="Median of the distribution.")
    sigma: float = Field(..., ge=0, description="Standard deviation of log(x).")
    lo: float | None = Field(None, description="Lower clip, if any.")
    hi: float | None = Field(None, description="Upper clip, if any.")


class ToolComponent(_Frozen):
    """One component of a tool-latency mixture."""

    weight: float = Field(..., gt=0, description="Mixture weight (weights are normalized).")
    latency_s: LogNormal = Field(..., description="Latency of one call, in seconds.")
    task_factor: bool = Field(False, description="Multiply by the task's heavy-tool factor.")


class ProfileConfig(_Frozen):
    """An agent workload: episode shapes as lognormals (docs/design/workloads.md, profiles A/B/C)."""

    name: str = Field("A", description="Short name used in reports.")
    turns: LogNormal = Field(
        LogNormal(median=60, sigma=0.5, lo=3, hi=250), description="Model turns per episode."
    )
    initial_prompt_tokens: int = Field(3000, ge=1, description="Prompt tokens of the first turn.")
    output_tokens: LogNormal = Field(
        LogNormal(median=150, sigma=0.9, lo=1, hi=16384), description="Generated tokens per turn."
    )
    observation_tokens: LogNormal = Field(
        LogNormal(median=400, sigma=1.1, lo=1, hi=8000),
        description="Tool observation tokens appended after each turn but the last.",
    )
    tool_latency: list[ToolComponent] = Field(
        default_factory=lambda: [
            ToolComponent(weight=0.60, latency_s=LogNormal(median=0.3, sigma=0.8)),
            ToolComponent(weight=0.35, latency_s=LogNormal(median=1.0, sigma=1.0)),
            ToolComponent(weight=0.05, latency_s=LogNormal(median=20.0, sigma=1.0), task_factor=True),
        ],
        description="Mixture of tool-call latencies (empty: no tool calls).",
    )
    task_factor: LogNormal = Field(
        LogNormal(median=1.0, sigma=1.2), description="Per-task multiplier of heavy tool calls."
    )
    tool_cap_s: float = Field(600.0, gt=0, description="Cap of one tool call, seconds.")
    sandbox_start_s: LogNormal | None = Field(
        LogNormal(median=5.0, sigma=1.0), description="Sandbox start before the first turn."
    )
    reward_s: LogNormal | None = Field(
        LogNormal(median=30.0, sigma=0.8), description="Reward computation after the last turn."
    )
    group_size: int = Field(4, ge=1, le=64, description="Executions per task (one group).")
    group_length_factor: LogNormal | None = Field(
        None, description="Per-task factor on output lengths, shared by a group (profile B)."
    )
    max_total_output_tokens: int = Field(
        1_000_000, ge=1, description="Clip of an episode's total generated tokens (e.g. 16k/28k/64k)."
    )


class DriftConfig(_Frozen):
    """Length drift: the median output length grows per policy version, with one jump."""

    growth_per_version: float = Field(0.0, ge=0, le=0.1, description="Relative growth per version.")
    jump_at_version: int = Field(-1, description="Version from which the jump applies (-1: none).")
    jump_factor: float = Field(1.0, gt=0, description="Multiplier applied from jump_at_version on.")
    turns_too: bool = Field(False, description="Also scale the number of turns.")

    def factor(self, version: int) -> float:
        f = (1.0 + self.growth_per_version) ** max(version, 0)
        if 0 <= self.jump_at_version <= version:
            f *= self.jump_factor
        return f


GPU_PRESETS: dict[str, dict[str, float]] = {
    "h100": {"gpu_memory_bytes": 80e9, "hbm_bw": 3.35e12, "flops": 989e12},
    "h200": {"gpu_memory_bytes": 141e9, "hbm_bw": 4.8e12, "flops": 989e12},
}
"""Published figures of one GPU (NVIDIA's H100 SXM and H200 data sheets): memory, HBM bandwidth,
dense bf16 FLOP/s. ``CostConfig.gpu`` picks one; the preset wins over the fields it sets, so a
what-if (``cost.gpu=h100``) changes all three at once."""


class CostConfig(_Frozen):
    """The GPU cost model of docs/design/workloads.md (defaults: a 7B model, one H200 per cell),
    with the constants fitted to published measurements in docs/benchmarks/cluster.md
    ("Cost model")."""

    gpu: Literal["h100", "h200"] | None = Field(
        "h200",
        description="GPU preset (GPU_PRESETS: memory, bandwidth, FLOP/s; it overrides those fields). "
        "None: take gpu_memory_bytes, hbm_bw and flops as given.",
    )
    n_params: float = Field(7.6e9, gt=0, description="Model parameters N.")
    weight_bytes: float = Field(15.2e9, gt=0, description="Bytes of weights read per decode step.")
    n_layers: int = Field(28, ge=1, description="Transformer layers L.")
    d_model: int = Field(3584, ge=1, description="Hidden size d.")
    n_kv_heads: int = Field(4, ge=1, description="KV heads (grouped-query attention).")
    head_dim: int = Field(128, ge=1, description="Dimension of one attention head.")
    kv_dtype_bytes: int = Field(2, ge=1, description="Bytes of one KV element (bf16: 2).")
    kv_bytes_per_token: float = Field(
        57344,
        gt=0,
        description="KV-cache bytes per context token: derived, layers x kv_heads x head_dim x 2 (K and V) "
        "x dtype bytes (Qwen2.5-7B: 28 x 4 x 128 x 2 x 2 = 57,344); a given value must agree.",
    )
    gpu_memory_bytes: float = Field(141e9, gt=0, description="Memory of one GPU (set by `gpu`).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory the engine takes (vLLM's default 0.9)."
    )
    activation_bytes: float = Field(
        4e9,
        ge=0,
        description="Per GPU, what the engine reserves besides weights and KV (activations of the "
        "largest batch, CUDA graphs): about 4 GB for a 7B model.",
    )
    kv_capacity: bool = Field(
        True,
        description="Engines hold at most kv_capacity_tokens of KV: they admit what fits, evict cached "
        "prefixes (LRU) and preempt the youngest running sequence (recompute), as vLLM does. False: "
        "unlimited KV (the model before issue 33).",
    )
    kv_watermark: float = Field(
        0.01, ge=0, lt=1, description="Share of KV a waiting sequence must leave free to be admitted."
    )
    hbm_bw: float = Field(4.8e12, gt=0, description="HBM bandwidth per GPU, bytes/s (set by `gpu`).")
    hbm_eff: float = Field(0.85, gt=0, le=1, description="Achieved fraction of HBM bandwidth.")
    flops: float = Field(989e12, gt=0, description="Dense bf16 FLOP/s per GPU (set by `gpu`).")
    decode_flops_eff: float = Field(0.5, gt=0, le=1, description="Achieved FLOP fraction, decode.")
    prefill_flops_eff: float = Field(0.5, gt=0, le=1, description="Achieved FLOP fraction, prefill.")
    train_flops_eff: float = Field(0.35, gt=0, le=1, description="Achieved FLOP fraction (MFU), training.")
    train_logprob_pass: bool = Field(
        True, description="Training adds the old-policy log-prob forward pass (2N per token)."
    )
    train_attention: bool = Field(
        True,
        description="Training adds attention FLOPs: 4*L*d per token per attended token forward, x3 "
        "forward + backward, x1 more for the log-prob pass.",
    )
    decode_step_overhead_s: float = Field(
        0.0015, ge=0, description="Fixed cost of one decode step (vLLM V1 with CUDA graphs)."
    )
    gpus_per_cell: int = Field(1, ge=1, description="GPUs in one cell.")
    train_step_fixed_s: float = Field(2.0, ge=0, description="Fixed cost of one optimizer update.")
    switch_to_train_s: float = Field(2.0, ge=0, description="Rollout -> train (sleep + optimizer in).")
    switch_to_rollout_s: float = Field(1.5, ge=0, description="Train -> rollout (wake).")
    weight_sync_s: float = Field(0.1, ge=0, description="Pushing/pulling one weight version.")
    kv_handoff_s: float = Field(
        0.04,
        ge=0,
        description="Fixed latency of one KV handoff on a reroute (pin, seal, read set-up, "
        "the destination's asynchronous load): measured by bench/engine_vllm.py.",
    )
    kv_handoff_bytes_per_s: float = Field(
        50e9,
        gt=0,
        description="Bandwidth of the KV transfer between two cells (NVLink / CUDA IPC / "
        "NCCL point to point); a handoff of ctx tokens adds ctx * kv_bytes_per_token / this.",
    )
    kv_handoff: bool = Field(False, description="Reroutes move KV (else the prefix is recomputed).")

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        """Fills the GPU preset's fields and the KV bytes per token from the model's shapes, so
        that capacity follows from the hardware and the model rather than a free constant."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        gpu = data.get("gpu", cls.model_fields["gpu"].default)
        if gpu is not None:
            if gpu not in GPU_PRESETS:
                raise ValueError(f"cost.gpu: unknown preset {gpu!r} (known: {sorted(GPU_PRESETS)})")
            data.update(GPU_PRESETS[gpu])
        f = cls.model_fields
        shape = [data.get(k, f[k].default) for k in ("n_layers", "n_kv_heads", "head_dim", "kv_dtype_bytes")]
        derived = float(shape[0] * shape[1] * shape[2] * 2 * shape[3])
        given = data.get("kv_bytes_per_token")
        if given is not None and abs(float(given) - derived) > 0.5:
            raise ValueError(
                f"cost.kv_bytes_per_token {given} disagrees with the shapes "
                f"(layers x kv_heads x head_dim x 2 x dtype bytes = {derived:.0f})"
            )
        data["kv_bytes_per_token"] = derived
        return data

    @property
    def kv_capacity_tokens(self) -> float:
        """KV tokens one cell's engine holds: the engine's share of GPU memory less the weights
        (split over the cell's GPUs) and the activation reserve, over the KV bytes per token
        (inf when ``kv_capacity`` is off)."""
        if not self.kv_capacity:
            return float("inf")
        g = self.gpus_per_cell
        free = g * (self.gpu_memory_bytes * self.gpu_memory_utilization - self.activation_bytes)
        return max(0.0, free - self.weight_bytes) / self.kv_bytes_per_token


class ClusterConfig(_Frozen):
    """Cells and their rollout slots."""

    cells: int = Field(64, ge=1, le=4096, description="Elastic cells (index 0 is the core).")
    standalone_cells: int = Field(0, ge=0, description="Rollout-only cells (not counted in `cells`).")
    slots_per_cell: int = Field(48, ge=1, description="Concurrent executions an engine serves.")
    placement: Literal["scheduler", "least_loaded"] = Field(
        "scheduler",
        description="Where launches and reroutes go: the scheduler's own placement_order (standalone, "
        "then rollout cells by descending index, filling each) or the least loaded rollout engine.",
    )


class TrainingConfig(_Frozen, StaleRuleSettings):
    """Bursts and batches, and the rule for unconsumable groups (the scheduler's own
    :class:`StaleRuleSettings`)."""

    batch_groups: int = Field(64, ge=1, description="Groups per training batch (one update each).")
    overprovision: float = Field(0.25, ge=0, le=4, description="Extra executions dispatched per burst.")
    updates: int = Field(20, ge=1, description="Stop after this many policy updates.")
    horizon_s: float = Field(7 * 86400.0, gt=0, description="Give up after this much simulated time.")


class PolicyParams(_Frozen, GyreSettings):
    """Parameters handed to the scheduler's policies (names follow services/scheduler/policy;
    the ``gyre_*`` ones are the scheduler's own :class:`GyreSettings`)."""

    supply_fraction: float = Field(0.5, gt=0, le=1, description="Ready groups needed / batch_size.")
    supply_interval_s: float = Field(5.0, ge=0, description="How long the supply must hold.")
    drain_grace_s: float = Field(
        2.0, ge=0, description="How long W must stay 0 before a burst counts as drained."
    )
    colocated_overprovision: float = Field(
        0.0, ge=0, le=4, description="Over-provision of colocated sync (0: verl's synchronous batch)."
    )
    rate_window_s: float = Field(
        600.0,
        gt=0,
        description="Window over which the rates the asynchronous policies see (ready groups) are measured.",
    )


class TargetConfig(_Frozen):
    """What a scenario must show (issue 12's targets): Gyre's time against a baseline's."""

    baseline: str = Field("oracle_async_static", description="Role of the baseline (see `policies`).")
    ratio: float = Field(1.0, gt=0, description="Least baseline time / Gyre time (median over seeds).")
    min_efficiency: float | None = Field(None, gt=0, le=1, description="Least T*_eta / Gyre time, if any.")


class ScenarioConfig(_Frozen):
    """One benchmark scenario: a profile, a cluster and a seed."""

    name: str = Field(..., description="Scenario name (used in file names and tables).")
    static_training_cells: list[int] | None = Field(
        None, description="This scenario's split sweep (None: the config's `static_training_cells`)."
    )
    prior_from: str | None = Field(
        None,
        description="A neighbouring scenario whose oracle split (as a share of the cells) is this "
        "one's prior static split when it runs one seed only (the 256- and 1,024-cell scenarios).",
    )
    profile: str = Field(
        "A", description="Key of `profiles` (with `mix`: the one whose group size every task takes)."
    )
    mix: dict[str, float] = Field(
        default_factory=dict,
        description="Mixed tasks: profile key -> weight; each task's profile is drawn by (seed, task). "
        "Empty: `profile` only.",
    )
    seed: int = Field(1, description="Seed of the trace (same trace for every policy).")
    seeds: list[int] = Field(
        default_factory=list,
        description="Seeds the benchmark runs the scenario on (min / median / max reported); empty: `seed` only.",
    )
    drift: DriftConfig = Field(default_factory=DriftConfig, description="Length drift.")
    target: TargetConfig | None = Field(None, description="The target the report checks (None: none).")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Cells.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Batches.")


SPLIT_POLICIES = ("static", "async-static", "async-static-lend")
"""Policies with a fixed number of training cells T: the benchmark sweeps T."""


class PolicyEntry(_Frozen):
    """One row of the comparison: a role, and the policies that may fill it."""

    role: str = Field(
        ..., description="Row name in reports and the summary (gyre, colocated, oracle_async_static, ...)."
    )
    policy: list[str] = Field(
        ...,
        min_length=1,
        description="Candidates from the scheduler's policy registry (services.scheduler.policy.make_policy); "
        "the first one it knows runs, so a policy plugs in as it lands. None known: the row is reported missing.",
    )
    sweep: bool = Field(
        False, description="Sweep the training cells T over `static_training_cells`: the best is the oracle."
    )
    at: str | None = Field(
        None,
        description="Run once at the training cells and placement of this (swept) row's oracle "
        "instead of sweeping (e.g. lending at the oracle async static split).",
    )
    placements: list[Literal["scheduler", "least_loaded"]] = Field(
        default_factory=list,
        description="Placements of the sweep: every T on the first, the best T and its neighbours on the others "
        "(empty: the scenario's).",
    )
    split: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Run once with this share of the cells training (0.5: the 50:50 split a user picks "
        "without measuring), on the first of `placements` (empty: the scenario's).",
    )
    prior: str | None = Field(
        None,
        description="Run once at the split that this (swept) row's oracle chose on another seed of the "
        "scenario (the next seed, cyclically), or, with one seed, on the scenario's `prior_from`: the "
        "split a user carries over from an earlier run, chosen without hindsight on this one.",
    )


def _entry(x: Any) -> Any:
    """A bare policy name is a row of its own name (swept when it is a split)."""
    if isinstance(x, str):
        return {"role": x, "policy": [x], "sweep": x in SPLIT_POLICIES}
    return x


class HygieneTargets(_Frozen):
    """Upper limits the report checks Gyre's run against (issue 12, "Hygiene")."""

    dropped_share: float = Field(0.05, ge=0, description="Dropped or cancelled groups / dispatched groups.")
    switch_reroute_share: float = Field(0.02, ge=0, description="Role-switch + reroute GPU-s / all GPU-s.")
    trainer_idle: float = Field(0.15, ge=0, description="Idle share of the training side.")
    rollout_idle: float = Field(0.15, ge=0, description="Idle share of the rollout side.")


class SuiteConfig(_Frozen):
    """A named subset of the benchmark (``bench/cluster.py --suite NAME``)."""

    scenarios: list[str] = Field(default_factory=list, description="Scenario names (empty: all).")
    overrides: list[str] = Field(
        default_factory=list, description="Dotted `key=value` overrides for the suite."
    )


class SimConfig(_Frozen):
    """The whole benchmark: profiles, cost model, policy parameters and scenarios."""

    profiles: dict[str, ProfileConfig] = Field(
        default_factory=lambda: {"A": ProfileConfig()}, description="Workload profiles by key."
    )
    cost: CostConfig = Field(default_factory=CostConfig, description="GPU cost model.")
    policy: PolicyParams = Field(default_factory=PolicyParams, description="Policy parameters.")
    policies: list[PolicyEntry] = Field(
        default_factory=lambda: [
            PolicyEntry(role="gyre", policy=["gyre", "waterlevel"]),
            PolicyEntry(role="colocated", policy=["colocated"]),
            PolicyEntry(role="oracle_bursty_static", policy=["static"], sweep=True),
        ],
        description="Compared rows (a bare name is a row of its own name).",
    )
    static_training_cells: list[int] = Field(
        default_factory=lambda: [8, 16, 24, 32, 48],
        description="Split sweep: training-cell counts T (refined around the best).",
    )
    sweep_refine: bool = Field(True, description="Refine a sweep around its best coarse point.")
    switch_sensitivity: float | None = Field(
        5.0,
        gt=0,
        description="Rerun Gyre and the oracle async static split (at its best T, not re-swept) with the "
        "role-switch and weight-sync costs times this factor (None: no sensitivity rows).",
    )
    sweep_cutoff: float | None = Field(
        None,
        gt=1,
        description="Stop a sweep point once it runs this factor past the best point so far (it cannot "
        "be the oracle; reported as cut). None: run every point to N.",
    )
    variants: dict[str, list[str]] = Field(
        default_factory=dict,
        description="What-if runs of the gyre row's policy on each scenario's first seed: name -> overrides "
        "(`cost.kv_handoff=true`; keys starting with `scenario.` apply to each scenario, e.g. "
        "`scenario.cluster.placement=least_loaded`).",
    )
    targets: HygieneTargets = Field(default_factory=HygieneTargets, description="Hygiene limits.")
    suites: dict[str, SuiteConfig] = Field(default_factory=dict, description="Named subsets (`--suite`).")
    scenarios: list[ScenarioConfig] = Field(
        default_factory=lambda: [ScenarioConfig(name="A64")], description="Scenarios to run."
    )

    @field_validator("policies", mode="before")
    @classmethod
    def _bare_names(cls, v: Any) -> Any:
        return [_entry(x) for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _profiles_exist(self) -> SimConfig:
        for s in self.scenarios:
            for key in [s.profile, *s.mix]:
                if key not in self.profiles:
                    raise ValueError(f"scenario {s.name}: unknown profile {key!r}")
            if any(w <= 0 for w in s.mix.values()):
                raise ValueError(f"scenario {s.name}: mix weights must be positive")
        roles = [p.role for p in self.policies]
        if len(set(roles)) != len(roles):
            raise ValueError(f"policies: duplicate roles in {roles}")
        return self

    def scenario(self, name: str) -> ScenarioConfig:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets ``a.b.c`` in nested dicts; list items are addressed by index or, for scenarios,
    by name (``scenarios.A64.seed=3``)."""
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = next(
                (j for j, it in enumerate(node) if isinstance(it, dict) and it.get("name") == part), None
            )
            if idx is None:
                idx = int(part)
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})


def apply_variant(
    cfg: SimConfig, sc: ScenarioConfig, overrides: list[str]
) -> tuple[SimConfig, ScenarioConfig]:
    """``cfg`` and ``sc`` with a variant's overrides applied (see ``SimConfig.variants``)."""
    top = cfg.model_dump()
    scen = sc.model_dump()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value")
        key = key.strip()
        if key.startswith("scenario."):
            _set_dotted(scen, key[len("scenario.") :], yaml.safe_load(raw))
        else:
            _set_dotted(top, key, yaml.safe_load(raw))
    top["scenarios"] = [scen]
    new = SimConfig.model_validate(top)
    return new, new.scenarios[0]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SimConfig:
    """Reads ``path`` (YAML) and applies ``overrides`` of the form ``dotted.key=yaml-value``."""
    data: dict[str, Any] = {}
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        # Top-level keys starting with "_" hold YAML anchors (building blocks), not settings.
        data = {k: v for k, v in data.items() if not str(k).startswith("_")}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return SimConfig.model_validate(data)
