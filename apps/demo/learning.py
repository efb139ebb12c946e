"""What the demo's policy learned: the held-out evaluation per policy version, the training
reward keyed by the version that *generated* each episode's tokens (from the packer's event
log, read through its API: its turns carry every token's version, its finish reports the
reward), and the core's loss diagnostics per step (from its history). ``learning.png`` draws them; ``summary.json`` and
the TensorBoard files carry them.

The dispatch stamp of an execution is not the version that generated it: a long episode's
turns may be served by two or three versions, so the training reward here is keyed by the
version that generated most of the episode's tokens.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gyre.history import read as read_history


def reward_by_generating_version(events: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """Mean reward and count of the completed episodes, by the policy version that generated
    most of their output tokens (WAL events: ``turn`` and ``finish``)."""
    tokens: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    rewards: dict[str, float] = {}
    for ev in events:
        if ev.get("t") == "turn":
            turn = ev["turn"]
            mask = turn.get("m") or [1] * len(turn.get("v", []))
            tokens[turn["x"]].update(v for v, m in zip(turn.get("v", []), mask, strict=False) if m)
        elif ev.get("t") == "finish":
            fin = ev["finish"]
            if fin.get("s") == "completed":
                rewards[fin["x"]] = float(fin.get("r", 0.0))
    by_version: dict[int, list[float]] = collections.defaultdict(list)
    for execution, reward in rewards.items():
        if tokens.get(execution):
            version = tokens[execution].most_common(1)[0][0]
            by_version[version].append(reward)
    return {v: {"mean": statistics.fmean(r), "n": len(r)} for v, r in sorted(by_version.items())}


def step_diagnostics(history_file: str | Path) -> list[dict[str, Any]]:
    """The core's loss diagnostics per applied step, in version order (its ``step`` lines)."""
    path = Path(history_file)
    if not path.exists():
        return []
    steps: dict[int, dict[str, Any]] = {}
    for op in read_history(path):
        if op.get("op") == "step" and op.get("applied") and op.get("diag"):
            steps[int(op["new_v"])] = {"version": int(op["new_v"]), **op["diag"]}
    return [steps[v] for v in sorted(steps)]


def diagnostics_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's diagnostics in brief: means over the steps, the last step, the lag histogram
    summed over every trained token."""
    if not steps:
        return {}
    names = (
        "clip_fraction",
        "behaviour_weight_mean",
        "behaviour_weight_capped_share",
        "entropy",
        "grad_norm",
        "logprob_gap_lag0",
        "lag_mean",
    )
    lag = [
        sum(s.get("lag_hist", [0])[k] if k < len(s.get("lag_hist", [])) else 0 for s in steps)
        for k in range(8)
    ]
    return {
        "steps": len(steps),
        "mean": {n: round(statistics.fmean(float(s.get(n, 0.0)) for s in steps), 4) for n in names},
        "behaviour_weight_max": round(max(float(s.get("behaviour_weight_max", 0.0)) for s in steps), 4),
        "lag_hist_tokens": lag,
        "last": steps[-1],
    }


def write_tensorboard(
    logdir: str | Path, evals: list[dict[str, Any]], rewards: Mapping[int, Mapping[str, float]]
) -> None:
    """The demo's own curves beside the core's step scalars: ``eval/reward`` (with its 95%
    interval) and ``rollout/reward`` by generating version."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for e in evals:
            writer.add_scalar("eval/reward", e["mean"], e["version"])
            writer.add_scalar("eval/ci95_lo", e["ci95"][0], e["version"])
            writer.add_scalar("eval/ci95_hi", e["ci95"][1], e["version"])
        for version, r in sorted(rewards.items()):
            writer.add_scalar("rollout/reward", r["mean"], version)
            writer.add_scalar("rollout/episodes", r["n"], version)
    finally:
        writer.close()


def plot_learning(
    evals: list[dict[str, Any]],
    rewards: Mapping[int, Mapping[str, float]],
    out: str | Path,
    steps: list[dict[str, Any]] | None = None,
    title: str = "Gyre demo: what the policy learned",
) -> Path:
    """learning.png: held-out reward per version with 95% intervals, training reward by
    generating version, and (beneath) the behaviour weight and lag of each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if steps else 1
    fig, axes = plt.subplots(panels, 1, figsize=(10, 4.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    if evals:
        xs = [e["version"] for e in evals]
        ys = [e["mean"] for e in evals]
        lo = [e["mean"] - e["ci95"][0] for e in evals]
        hi = [e["ci95"][1] - e["mean"] for e in evals]
        ax.errorbar(
            xs, ys, yerr=[lo, hi], fmt="o-", color="#3b6fd8", capsize=4, lw=2, label="held-out eval (95% CI)"
        )
    if rewards:
        vs = sorted(rewards)
        ax.plot(
            vs,
            [rewards[v]["mean"] for v in vs],
            "s--",
            color="#2e9d57",
            alpha=0.8,
            label="training episodes, by generating version",
        )
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if steps:
        ax2 = axes[1][0]
        vs = [s["version"] for s in steps]
        ax2.plot(
            vs, [s.get("behaviour_weight_mean", 0.0) for s in steps], "o-", label="behaviour weight (mean)"
        )
        ax2.plot(
            vs, [s.get("lag_mean", 0.0) for s in steps], "^-", label="version lag of trained tokens (mean)"
        )
        ax2.plot(vs, [s.get("entropy", 0.0) for s in steps], "x-", label="entropy")
        ax2.set_ylabel("per step")
        ax2.grid(alpha=0.3)
        ax2.legend(loc="best")
    axes[-1][0].set_xlabel("policy version")
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions_to_evaluate(run_dir: str | Path) -> dict[int, Any]:
    """The trained versions whose weights the run kept: every N-th (``versions/``) and the
    core's newest checkpoint, as ``version -> state dict loader``."""
    from services.cell_agent.training.checkpoint import Checkpointer
    from services.cell_agent.training.steplog import kept_versions

    ckpt_dir = Path(run_dir) / "checkpoints"
    out: dict[int, Any] = {}
    for version, path in kept_versions(ckpt_dir).items():
        out[version] = lambda path=path: _load(path)
    if ckpt_dir.is_dir():
        rec = Checkpointer(ckpt_dir, keep=1_000).latest()
        if rec is not None and rec.version > 0:
            out[rec.version] = lambda rec=rec: rec.model
    return dict(sorted(out.items()))


def _load(path: Path) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def evaluate_version(
    v0_dir: Path, state: Any, version: int, tasks: list[Any], env: Any, samples: int, seed: int
) -> dict[str, Any]:
    """The held-out evaluation of one version: v0's directory with ``state`` loaded (None:
    v0 itself). The same tasks and sampling seed for every version."""
    from apps.eval.local import Policy, evaluate

    policy = Policy.load(v0_dir)
    if state is not None:
        policy.model.load_state_dict(state)
        policy.model.eval()
    result = evaluate(policy, tasks, env, samples_per_task=samples, seed=seed)
    return {"version": version, **result.summary()}


def separated(first: Mapping[str, Any], last: Mapping[str, Any]) -> bool:
    """The last evaluation's 95% interval lies wholly above the first's."""
    return bool(last["ci95"][0] > first["ci95"][1])
