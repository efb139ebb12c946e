"""The physical limit T* = max(work bound, critical path) of a scenario (WORKLOADS.md).

For update k (k = 0..N-1) the bound looks at the groups dispatched for it (the burst's
quota with over-provision, drawn at version k) and lets the best case pick the
``batch_groups`` cheapest of them:

* work bound = (rollout GPU-s of the picked groups at the best feasible decode batch
  (``slots_per_cell`` sequences sharing each weight read) + their prefill GPU-s + their
  training GPU-s + one fixed optimizer cost per update) / cells;
* critical path = the slowest episode that some update must wait for, at the best
  per-sequence speed (alone on an engine) with its sandbox, tool and reward waits, plus the
  final training step on every cell. For each update that is the ``batch_groups``-th fastest
  group of its quota; the bound takes the largest over updates (one burst's latency is a
  floor that no amount of overlap removes).

It is a lower bound under the shared assumptions (the trace, the cost model, one batch per
update); it ignores role switches, reroutes and weight sync, which are costs of a policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.config import ScenarioConfig, SimConfig
from sim.cost import CostModel
from sim.workload import Episode, Trace


@dataclass(frozen=True)
class Bound:
    """T* and its parts, in seconds."""

    t_star_s: float
    work_bound_s: float
    critical_path_s: float
    rollout_gpu_s: float
    prefill_gpu_s: float
    train_gpu_s: float
    slowest_needed_group_s: float


def _episode_costs(ep: Episode, cost: CostModel, best_batch: int) -> tuple[float, float, float]:
    """(decode GPU-s at the best batch, prefill GPU-s, latency alone at best speed)."""
    ctx = 0
    decode_gpu = 0.0
    prefill = 0.0
    alone = ep.sandbox_s + ep.reward_s
    for k, n in enumerate(ep.output_tokens):
        p = ep.prompt_tokens[k]
        pf = cost.prefill_s(p, ctx)
        ctx += p
        prefill += pf
        batched = cost.decode_rate(best_batch, best_batch * ctx).time(0.0, n) / best_batch
        single = cost.decode_rate(1, ctx).time(0.0, n)
        decode_gpu += batched
        alone += pf + single + ep.tool_s[k]
        ctx += n
    return decode_gpu, prefill, alone


def physical_limit(cfg: SimConfig, sc: ScenarioConfig) -> Bound:
    """T* for N = ``sc.training.updates`` updates of scenario ``sc``."""
    profile = cfg.profiles[sc.profile]
    trace = Trace(profile, sc.seed, sc.drift)
    cost = CostModel(cfg.cost)
    tr = sc.training
    cells = sc.cluster.cells
    per_burst = max(tr.batch_groups, math.ceil(tr.batch_groups * (1 + tr.overprovision) - 1e-9))
    best_batch = sc.cluster.slots_per_cell
    rollout = prefill = train = 0.0
    slowest = 0.0
    last_train_tokens = 0
    tok_s = cost.train_tokens_per_cell_s()
    for k in range(tr.updates):
        groups = []
        for task in range(k * per_burst, (k + 1) * per_burst):
            eps = trace.group(task, k)
            parts = [_episode_costs(ep, cost, best_batch) for ep in eps]
            tokens = sum(ep.total_tokens for ep in eps)
            work = sum(d + p for d, p, _ in parts) + tokens / tok_s
            latency = max(a for _, _, a in parts)
            groups.append((work, latency, sum(d for d, _, _ in parts), sum(p for _, p, _ in parts), tokens))
        by_work = sorted(groups)[: tr.batch_groups]
        rollout += sum(g[2] for g in by_work)
        prefill += sum(g[3] for g in by_work)
        tokens_k = sum(g[4] for g in by_work)
        train += tokens_k / tok_s + cfg.cost.train_step_fixed_s
        last_train_tokens = tokens_k
        needed = sorted(g[1] for g in groups)[tr.batch_groups - 1]
        slowest = max(slowest, needed)
    work_bound = (rollout + prefill + train) / cells
    critical = slowest + cost.train_s(last_train_tokens, cells)
    return Bound(
        t_star_s=max(work_bound, critical),
        work_bound_s=work_bound,
        critical_path_s=critical,
        rollout_gpu_s=rollout,
        prefill_gpu_s=prefill,
        train_gpu_s=train,
        slowest_needed_group_s=slowest,
    )
