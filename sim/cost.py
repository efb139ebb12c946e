"""The GPU cost model: decode as bytes read, prefill as FLOPs, training steps, role switches,
and the KV capacity of one cell's engine.

Decode (docs/design/workloads.md, "GPU cost model"): one step of a batch of B sequences with
total context S costs ``max((weights + S*kv_bytes) / (hbm_eff*BW), 2*N*B / (eff*FLOPS)) +
overhead`` and emits one token per sequence. Every sequence in the batch gains a token per
step, so S grows by B per step: the step time is linear in the engine's virtual token clock V
(tokens emitted per sequence), which ``DecodeRate`` integrates exactly instead of assuming a
constant rate.

Training (``train_work_tokens``): a sequence of S tokens costs 6N per token for the update,
2N more for the old-policy log-prob forward pass, and attention (4*L*d FLOPs per token per
attended token forward, S/2 attended on average under the causal mask, x3 for forward and
backward, x1 more for the log-prob pass). The trainer's rate stays the 6N rate and a group's
work is counted in 6N-equivalent tokens, so the policies' arithmetic (tokens over a rate) holds.
"""

from __future__ import annotations

import math

from sim.config import CostConfig


class DecodeRate:
    """Step time as a function of V for a fixed batch: s(V) = max(comp, m0 + m1*V) + oh,
    where m0 + m1*V is the memory time. ``time(v0, v1)`` integrates s; ``advance(v0, dt)``
    inverts it. (A plain slotted class: it is built on every batch change.)"""

    __slots__ = ("c_oh", "comp", "k", "m0", "m1", "oh", "vc")

    def __init__(self, comp: float, m0: float, m1: float, oh: float) -> None:
        self.comp = comp
        self.m0 = m0
        self.m1 = m1
        self.oh = oh
        # Derived once (a rate is built per batch change and used once or twice).
        if m1 <= 0:
            self.vc = math.inf if m0 < comp else -math.inf
        else:
            self.vc = (comp - m0) / m1
        self.c_oh = comp + oh
        self.k = m0 + oh

    def __repr__(self) -> str:
        return f"DecodeRate(comp={self.comp!r}, m0={self.m0!r}, m1={self.m1!r}, oh={self.oh!r})"

    def step(self, v: float) -> float:
        return max(self.comp, self.m0 + self.m1 * v) + self.oh

    def time(self, v0: float, v1: float) -> float:
        """Seconds to advance from v0 to v1 (v1 >= v0)."""
        if v1 <= v0:
            return 0.0
        vc = self.vc
        t = 0.0
        if v0 < vc:
            seg_end = min(v1, vc)
            t += self.c_oh * (seg_end - v0)
            v0 = seg_end
        if v1 > v0:
            t += self.k * (v1 - v0) + 0.5 * self.m1 * (v1 * v1 - v0 * v0)
        return t

    def advance(self, v0: float, dt: float) -> float:
        """V reached after dt seconds from v0."""
        if dt <= 0:
            return v0
        vc = self.vc
        if v0 < vc:
            c = self.c_oh
            t_const = (vc - v0) * c if vc != math.inf else math.inf
            if dt <= t_const:
                return v0 + dt / c
            dt -= t_const
            v0 = vc
        k = self.k
        if self.m1 <= 1e-18:
            return v0 + dt / k
        # m1/2 v^2 + k v - (m1/2 v0^2 + k v0 + dt) = 0, solved stably.
        a = 0.5 * self.m1
        c = a * v0 * v0 + k * v0 + dt
        disc = k * k + 4 * a * c
        root = math.sqrt(disc)
        # The form that avoids cancellation for the sign of k.
        return (2 * c) / (k + root) if k >= 0 else (root - k) / (2 * a)


class CostModel:
    """Seconds of GPU time for each kind of work, from a ``CostConfig``."""

    def __init__(self, cfg: CostConfig) -> None:
        self.cfg = cfg
        bw = cfg.hbm_eff * cfg.hbm_bw * cfg.gpus_per_cell
        self._bw = bw
        self._decode_flops = cfg.decode_flops_eff * cfg.flops * cfg.gpus_per_cell
        self._prefill_flops = cfg.prefill_flops_eff * cfg.flops * cfg.gpus_per_cell
        self._train_flops_per_cell = cfg.train_flops_eff * cfg.flops * cfg.gpus_per_cell
        self._two_n = 2.0 * cfg.n_params
        self._wb = cfg.weight_bytes
        self._kv = cfg.kv_bytes_per_token
        self._oh = cfg.decode_step_overhead_s

    def decode_rate(self, batch: int, ctx_offset: float) -> DecodeRate:
        """Rate for ``batch`` sequences whose total context at V is ctx_offset + batch*V."""
        bw = self._bw
        kv = self._kv
        return DecodeRate(
            self._two_n * batch / self._decode_flops,
            (self._wb + kv * ctx_offset) / bw,
            kv * batch / bw,
            self._oh,
        )

    def decode_step_s(self, batch: int, total_ctx: float) -> float:
        """One decode step of ``batch`` sequences holding ``total_ctx`` context tokens."""
        return self.decode_rate(batch, total_ctx).step(0.0)

    def prefill_s(self, tokens: int, prefix: int) -> float:
        """Prefilling ``tokens`` new tokens after a cached prefix of ``prefix`` tokens: each
        token attends to the prefix plus, on average, half of the new tokens."""
        if tokens <= 0:
            return 0.0
        c = self.cfg
        ctx = prefix + tokens / 2.0
        return tokens * (2.0 * c.n_params + 4.0 * c.n_layers * c.d_model * ctx) / self._prefill_flops

    def kv_handoff_s(self, ctx: int) -> float:
        """Moving a request's KV (``ctx`` tokens) to another cell instead of recomputing it:
        the handoff's fixed latency plus the bytes over the transfer's bandwidth."""
        c = self.cfg
        return c.kv_handoff_s + ctx * c.kv_bytes_per_token / c.kv_handoff_bytes_per_s

    @property
    def kv_capacity_tokens(self) -> float:
        """KV tokens one engine holds (``CostConfig.kv_capacity_tokens``)."""
        return self.cfg.kv_capacity_tokens

    def train_tokens_per_cell_s(self) -> float:
        """Training throughput of one cell in 6N-equivalent tokens/s (see ``train_work_tokens``)."""
        return self._train_flops_per_cell / (6.0 * self.cfg.n_params)

    def train_work_tokens(self, seq_tokens: float) -> float:
        """The training work of one sequence of ``seq_tokens`` tokens in 6N-equivalent tokens:
        the update's 6N, the log-prob pass's 2N and the attention FLOPs of both (module
        docstring); at 44.5k tokens about 2.1x the bare 6N count, at 8k about 1.5x."""
        c = self.cfg
        per_token = 6.0 * c.n_params
        if c.train_logprob_pass:
            per_token += 2.0 * c.n_params
        if c.train_attention:
            passes = 4.0 if c.train_logprob_pass else 3.0
            per_token += passes * 4.0 * c.n_layers * c.d_model * (seq_tokens / 2.0)
        return seq_tokens * per_token / (6.0 * c.n_params)

    def train_s(self, tokens: float, cells: int) -> float:
        """A whole synchronous step on ``cells`` cells: fixed cost + work/(n * 6N rate), with
        ``tokens`` in 6N-equivalent tokens (``train_work_tokens``)."""
        return self.cfg.train_step_fixed_s + tokens / (cells * self.train_tokens_per_cell_s())
