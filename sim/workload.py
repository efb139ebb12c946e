"""Workload traces: episodes of profiles A/B/C drawn from lognormals, reproducible per seed.

An episode's random draws depend only on (seed, task index, member), never on the policy or
on when it runs, so every policy sees the same trace. Drift scales the output lengths by a
factor of the policy version the episode is dispatched with (docs/design/workloads.md, "Drift").

Drawing an episode costs tens of microseconds and every policy of a benchmark replays the
same trace, so episodes are memoized per trace (``_EpisodeCache``: the few most recent
traces of this process, keyed by profile, seed and drift factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.config import DriftConfig, LogNormal, ProfileConfig, ScenarioConfig, SimConfig


@dataclass(frozen=True, slots=True)
class Episode:
    """One execution's shape: per turn the tokens appended before it (prompt or observation),
    the tokens it generates, and the tool time after it (0 after the last turn)."""

    task: int
    member: int
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    tool_s: tuple[float, ...]
    sandbox_s: float
    reward_s: float

    @property
    def turns(self) -> int:
        return len(self.output_tokens)

    @property
    def total_output(self) -> int:
        return sum(self.output_tokens)

    @property
    def total_tokens(self) -> int:
        """Final context length: every prompt, observation and generated token."""
        return sum(self.prompt_tokens) + sum(self.output_tokens)


def _ln(rng: np.random.Generator, d: LogNormal, size: int | None = None, scale: float = 1.0) -> np.ndarray:
    x = d.median * scale * np.exp(d.sigma * rng.standard_normal(size))
    if d.lo is not None or d.hi is not None:
        x = np.clip(x, d.lo if d.lo is not None else -np.inf, d.hi if d.hi is not None else np.inf)
    return x


class _EpisodeCache:
    """Episodes of the ``keep`` most recently used traces, by (task, member, drift factor)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._traces: dict[tuple, dict[tuple[int, int, float], Episode]] = {}

    def for_trace(self, key: tuple) -> dict[tuple[int, int, float], Episode]:
        eps = self._traces.pop(key, None)
        if eps is None:
            eps = {}
            while len(self._traces) >= self.keep:
                del self._traces[next(iter(self._traces))]
        self._traces[key] = eps  # most recent last
        return eps


_CACHE = _EpisodeCache(keep=4)


class Trace:
    """Draws episodes of one profile. ``episode(task, member, version)`` is a pure function of
    the seed and its arguments."""

    def __init__(self, profile: ProfileConfig, seed: int, drift: DriftConfig | None = None) -> None:
        self.profile = profile
        self.seed = seed
        self.drift = drift or DriftConfig()
        w = np.array([c.weight for c in profile.tool_latency], dtype=float)
        self._tool_w = (w / w.sum()).cumsum() if len(w) else w
        self._tool_c = [(c.latency_s.median, c.latency_s.sigma, c.task_factor) for c in profile.tool_latency]
        self._key = (profile.model_dump_json(), seed, self.drift.turns_too)
        self._factors: dict[int, float] = {}

    def _task_rng(self, task: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, task, 1_000_003])

    def episode(self, task: int, member: int, version: int = 0) -> Episode:
        drift = self._factors.get(version)
        if drift is None:
            drift = self._factors[version] = self.drift.factor(version)
        cache = _CACHE.for_trace(self._key)
        key = (task, member, drift)
        ep = cache.get(key)
        if ep is None:
            ep = cache[key] = self._draw(task, member, drift)
        return ep

    def _draw(self, task: int, member: int, drift: float) -> Episode:
        p = self.profile
        trng = self._task_rng(task)
        task_factor = float(_ln(trng, p.task_factor))
        length_factor = float(_ln(trng, p.group_length_factor)) if p.group_length_factor else 1.0
        rng = np.random.default_rng([self.seed, task, member])
        turn_scale = drift if self.drift.turns_too else 1.0
        n_turns = max(1, int(round(float(_ln(rng, p.turns, scale=turn_scale)))))
        if p.turns.hi is not None:
            n_turns = min(n_turns, int(p.turns.hi))
        out = np.maximum(1, np.rint(_ln(rng, p.output_tokens, n_turns, scale=drift * length_factor)))
        out = _clip_total(out.astype(np.int64), p.max_total_output_tokens)
        n_turns = len(out)
        obs = np.maximum(1, np.rint(_ln(rng, p.observation_tokens, max(n_turns - 1, 0)))).astype(np.int64)
        prompts = [p.initial_prompt_tokens] + obs.tolist()
        tools = [0.0] * n_turns
        if len(self._tool_w) and n_turns > 1:
            comp = np.searchsorted(self._tool_w, rng.random(n_turns - 1), side="right")
            z = rng.standard_normal(n_turns - 1).tolist()
            comps = self._tool_c
            last = len(comps) - 1
            cap = p.tool_cap_s
            exp = math.exp
            for k, (ci, zk) in enumerate(zip(comp.tolist(), z)):
                median, sigma, heavy = comps[min(last, ci)]
                t = median * exp(sigma * zk)
                if heavy:
                    t *= task_factor
                tools[k] = min(cap, t)
        sandbox = float(_ln(rng, p.sandbox_start_s)) if p.sandbox_start_s else 0.0
        reward = float(_ln(rng, p.reward_s)) if p.reward_s else 0.0
        return Episode(
            task=task,
            member=member,
            prompt_tokens=tuple(int(x) for x in prompts),
            output_tokens=tuple(int(x) for x in out.tolist()),
            tool_s=tuple(tools),
            sandbox_s=sandbox,
            reward_s=reward,
        )

    def group(self, task: int, version: int = 0) -> list[Episode]:
        return [self.episode(task, m, version) for m in range(self.profile.group_size)]


class MixedTrace:
    """Tasks of several profiles in one stream (a mixed-task scenario): each task's profile is
    drawn from the weights by (seed, task) alone, so every policy sees the same mix. Every
    profile takes the group size of the scenario's own profile (a burst is whole groups of
    one size)."""

    def __init__(
        self,
        profiles: list[tuple[ProfileConfig, float]],
        seed: int,
        drift: DriftConfig | None = None,
        group_size: int | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a mixed trace needs at least one profile")
        size = group_size or profiles[0][0].group_size
        self.traces = [Trace(p.model_copy(update={"group_size": size}), seed, drift) for p, _ in profiles]
        self.profile = self.traces[0].profile
        self.seed = seed
        w = np.array([wt for _, wt in profiles], dtype=float)
        self._cum = (w / w.sum()).cumsum().tolist()
        self._kinds: dict[int, int] = {}

    def kind(self, task: int) -> int:
        """Index (into the profiles given) of ``task``'s profile."""
        k = self._kinds.get(task)
        if k is None:
            u = float(np.random.default_rng([self.seed, task, 2_000_003]).random())
            k = next((i for i, c in enumerate(self._cum) if u < c), len(self._cum) - 1)
            self._kinds[task] = k
        return k

    def episode(self, task: int, member: int, version: int = 0) -> Episode:
        return self.traces[self.kind(task)].episode(task, member, version)

    def group(self, task: int, version: int = 0) -> list[Episode]:
        return self.traces[self.kind(task)].group(task, version)


def make_trace(cfg: SimConfig, sc: ScenarioConfig) -> Trace | MixedTrace:
    """The trace of a scenario: its profile, or the weighted mix of ``sc.mix``."""
    if not sc.mix:
        return Trace(cfg.profiles[sc.profile], sc.seed, sc.drift)
    return MixedTrace(
        [(cfg.profiles[k], w) for k, w in sc.mix.items()],
        sc.seed,
        sc.drift,
        group_size=cfg.profiles[sc.profile].group_size,
    )


def _clip_total(out: np.ndarray, cap: int) -> np.ndarray:
    """Truncates the turns so that the episode generates at most ``cap`` tokens."""
    c = np.cumsum(out)
    if c[-1] <= cap:
        return out
    k = int(np.searchsorted(c, cap, side="left"))
    kept = out[: k + 1].copy()
    kept[-1] -= int(c[k] - cap)
    return kept[kept > 0] if kept[-1] <= 0 else kept
