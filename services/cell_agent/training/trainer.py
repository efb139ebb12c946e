"""The per-cell trainer: the causal LM, the policy-gradient token loss (decoupled or coupled
PPO) with its diagnostics, and the gradient accumulator that sums token-loss gradients on
exactly one weight version.

Everything here is blocking torch work: callers run it off the event loop.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from gyre.errors import FailedPrecondition, InvalidArgument
from services.cell_agent.training.microstep import MicroStep, Sequence

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class StaleGradient(FailedPrecondition):
    """A gradient computed on a weight version other than the accumulation window's."""


OBJECTIVES = ("decoupled", "coupled")
LAG_BUCKETS = 8
"""Version-lag histogram buckets of the trained tokens: lag 0 .. 6, and 7 or more."""


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The token-level policy-gradient loss.

    ``decoupled`` (the default; AReaL's decoupled PPO objective, Fu et al. 2025): the
    trust region is anchored to the *proximal* policy, the weights the batch trains on, and
    each token is weighted by ``w = π_prox / π_behaviour``, the correction for having been
    sampled by an older policy::

        loss = -w · min(r·A, clip(r, 1-lo, 1+hi)·A),   r = π_θ / π_prox

    ``w`` is capped: a token with ``w > behaviour_weight_cap`` is masked out (its sampling
    policy is too far from the proximal one to correct for). With one optimizer step per
    batch, π_prox is the trainer's own log-prob at the batch's weights, detached, so no
    extra forward pass is needed (``r`` is 1 in value and its gradient is ∇log π_θ).

    ``coupled`` (standard PPO / GRPO): ``r = π_θ / π_behaviour`` clipped against the
    engine's log-probs. Under asynchrony the weights have already left the behaviour
    policy, so the clip zeroes the gradient of the tokens that moved the way their
    advantage wanted: it learns little from stale data.

    Log-probs are computed at each sequence's sampling ``temperature`` (logits / T), the
    distribution the engine sampled from; a greedy turn (T = 0) is scored at T = 1.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    objective: str = "decoupled"
    behaviour_weight_cap: float = 5.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InvalidArgument(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not self.behaviour_weight_cap > 1.0:
            raise InvalidArgument("behaviour_weight_cap must be > 1")


@dataclasses.dataclass
class LossStats:
    """Diagnostics of the trained tokens, as sums (they add across micro-steps and cells).

    ``tokens``: loss tokens; ``clipped``: tokens whose clipped branch was taken (the ratio
    outside the clip range in the direction the advantage pushes); ``weight_sum`` /
    ``weight_max`` / ``capped``: the behaviour weight π_prox / π_behaviour (decoupled) or the
    ratio π_θ / π_behaviour (coupled) and the tokens masked for exceeding the cap;
    ``entropy_sum``: the policy's entropy at each trained position; ``gap_sum`` /
    ``gap_tokens``: |log π_trainer − log π_engine| over the tokens of lag 0 (the two
    implementations' disagreement on the same weights); ``lag``: tokens per version lag.
    """

    tokens: float = 0.0
    clipped: float = 0.0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    capped: float = 0.0
    entropy_sum: float = 0.0
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    lag: list[float] = dataclasses.field(default_factory=lambda: [0.0] * LAG_BUCKETS)

    SUMS = ("tokens", "clipped", "weight_sum", "capped", "entropy_sum", "gap_sum", "gap_tokens")

    def add(self, other: LossStats) -> None:
        for name in self.SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.weight_max = max(self.weight_max, other.weight_max)
        self.lag = [a + b for a, b in zip(self.lag, other.lag, strict=True)]

    def sums_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The additive part as one float64 vector (reduced with SUM across cells)."""
        return torch.tensor(
            [getattr(self, n) for n in self.SUMS] + self.lag, dtype=torch.float64, device=device
        )

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, weight_max: float) -> LossStats:
        values = [float(x) for x in sums.tolist()]
        n = len(cls.SUMS)
        return cls(**dict(zip(cls.SUMS, values[:n], strict=True)), weight_max=weight_max, lag=values[n:])

    def summary(self) -> dict[str, float | list[float]]:
        """Per-token means and shares (what the metrics, the history and the demo report)."""
        n = max(self.tokens, 1.0)
        return {
            "tokens": self.tokens,
            "clip_fraction": self.clipped / n,
            "behaviour_weight_mean": self.weight_sum / n,
            "behaviour_weight_max": self.weight_max,
            "behaviour_weight_capped_share": self.capped / n,
            "entropy": self.entropy_sum / n,
            "logprob_gap_lag0": self.gap_sum / self.gap_tokens if self.gap_tokens else 0.0,
            "lag_hist": list(self.lag),
            "lag_mean": sum(i * c for i, c in enumerate(self.lag)) / n,
        }


@dataclasses.dataclass(frozen=True)
class TokenTargets:
    """What the loss needs beside the logits, as tensors [B, T] (``adv`` and ``temp``: [B]):
    the token ids, the loss mask, the behaviour log-probs, each token's version lag (0 when
    unknown), the sequence's advantage and sampling temperature (0 scored at 1)."""

    ids: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    lag: torch.Tensor
    adv: torch.Tensor
    temp: torch.Tensor

    @classmethod
    def of(
        cls,
        seqs: list[Sequence],
        version: int | None = None,
        width: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> TokenTargets:
        """``seqs`` padded right to ``width`` (default: the longest)."""
        b, t = len(seqs), width or max(len(s.token_ids) for s in seqs)
        ids = torch.zeros(b, t, dtype=torch.long, device=device)
        mask = torch.zeros(b, t, dtype=dtype, device=device)
        behav = torch.zeros(b, t, dtype=dtype, device=device)
        lag = torch.zeros(b, t, dtype=torch.long, device=device)
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids, device=device)
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=dtype, device=device)
            behav[i, :n] = torch.tensor(s.logprobs, dtype=dtype, device=device)
            if version is not None and s.policy_versions:
                lag[i, :n] = (version - torch.tensor(s.policy_versions, device=device)).clamp(
                    0, LAG_BUCKETS - 1
                )
        adv = torch.tensor([s.advantage for s in seqs], dtype=dtype, device=device)
        temp = torch.tensor(
            [s.temperature if s.temperature > 0 else 1.0 for s in seqs], dtype=dtype, device=device
        )
        return cls(ids, mask, behav, lag, adv, temp)


def token_losses(
    logits: torch.Tensor, seqs: list[Sequence], cfg: LossConfig, version: int | None = None
) -> tuple[torch.Tensor, int, LossStats]:
    """Sum of the policy-gradient losses of every loss token of ``seqs`` (padded right into
    ``logits`` [B, T, V]), the number of loss tokens, and their diagnostics. ``version``: the
    weights' version (for the lag of each token; None: every token counts as lag 0)."""
    # The loss in at least float32 (bf16 log-softmax over a vocabulary is too coarse).
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    targets = TokenTargets.of(seqs, version, logits.shape[1], dtype, logits.device)
    return target_losses(logits, targets, cfg)


def target_losses(
    logits: torch.Tensor, targets: TokenTargets, cfg: LossConfig
) -> tuple[torch.Tensor, int, LossStats]:
    """:func:`token_losses` on targets already in tensors (a pipeline's last stage gets
    them so)."""
    dtype = targets.mask.dtype
    ids, mask, behav, lag = targets.ids, targets.mask, targets.behav, targets.lag
    adv, temp = targets.adv, targets.temp
    # Token j is predicted from the logits at j-1: position 0 is never trained.
    logsm = torch.log_softmax(logits[:, :-1].to(dtype) / temp[:, None, None], dim=-1)
    logp = logsm.gather(-1, ids[:, 1:, None])[..., 0]
    m, behav, lag = mask[:, 1:], behav[:, 1:], lag[:, 1:]
    a = adv[:, None]
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1)
    if cfg.objective == "decoupled":
        prox = logp.detach()
        ratio = torch.exp((logp - prox) * m)  # 1 in value; gradient ∇log π_θ
        weight = torch.exp((prox - behav) * m)
        keep = m * (weight <= cfg.behaviour_weight_cap).to(dtype)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)
        loss = -(weight * surrogate * keep)
        clipped_branch = (ratio * a > torch.clamp(ratio, lo, hi) * a).detach()
    else:
        ratio = torch.exp((logp - behav) * m)  # masked positions: ratio 1, loss multiplied by 0
        weight = ratio.detach()
        keep = m
        unclipped, clipped = ratio * a, torch.clamp(ratio, lo, hi) * a
        loss = -torch.minimum(unclipped, clipped) * m
        clipped_branch = (unclipped > clipped).detach()
    with torch.no_grad():
        mb = m > 0
        lag0 = mb & (lag == 0)
        stats = LossStats(
            tokens=float(m.sum()),
            clipped=float((clipped_branch & mb).sum()),
            weight_sum=float((weight * m).sum()),
            weight_max=float(weight[mb].max()) if bool(mb.any()) else 0.0,
            capped=float((m - keep).sum()),
            entropy_sum=float((entropy * m).sum()),
            gap_sum=float((logp.detach() - behav).abs()[lag0].sum()),
            gap_tokens=float(lag0.sum()),
            lag=[float((lag[mb] == k).sum()) for k in range(LAG_BUCKETS)],
        )
    return loss.sum(), int(m.sum().item()), stats


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """The transformers causal LM at ``model_dir`` on ``device``, dropout off: gradients must
    not depend on which cell (or stage) computes a micro-step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    model.to(device)  # type: ignore[arg-type]  # transformers' decorator types `to` oddly
    model.config.attention_dropout = 0.0
    return model


class Trainer:
    """One cell's model and gradient accumulator.

    Gradients of micro-steps accumulate as a *sum* in ``param.grad`` together with the
    token count; the window is tied to the weight version it was opened on, and a gradient
    from any other version is refused. Loading weights with a window open is refused too.
    """

    def __init__(self, model: nn.Module, version: int, loss: LossConfig | None = None) -> None:
        self.model = model
        self.loss = loss or LossConfig()
        self.version = version
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.tokens = 0
        self.micro_steps = 0
        self.window_version: int | None = None
        self.stats = LossStats()
        """Diagnostics of the tokens accumulated in the open window."""
        self._lock = threading.Lock()
        model.train()
        for p in self.params:
            p.grad = None

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        version: int,
        dtype: str = "float32",
        device: str = "cpu",
        loss: LossConfig | None = None,
    ) -> Trainer:
        """Loads the transformers causal LM at ``model_dir`` (same architecture as the engine)."""
        return cls(load_model(model_dir, dtype, device), version, loss)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    # Accumulation --------------------------------------------------------------------

    def open_window(self, version: int) -> None:
        """Starts accumulating on ``version``; the weights must be that version."""
        with self._lock:
            if version != self.version:
                raise StaleGradient(f"weights are version {self.version}, batch wants {version}")
            if self.window_version is not None and self.window_version != version:
                raise StaleGradient(f"a window on version {self.window_version} is open")
            self.window_version = version

    def accumulate(self, step: MicroStep, version: int) -> int:
        """Forward + backward of one micro-step; adds the sum of its token losses'
        gradients to the window. Returns its loss-token count."""
        if self.window_version is None:
            self.open_window(version)
        if version != self.window_version or version != self.version:
            raise StaleGradient(f"gradient on version {version} refused: window is on {self.window_version}")
        seqs = list(step.sequences)
        width = max(len(s.token_ids) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        att = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids, device=self.device)
            att[i, : len(s.token_ids)] = 1
        logits = self.model(input_ids=ids, attention_mask=att).logits
        loss, n, stats = token_losses(logits, seqs, self.loss, version)
        if n:
            loss.backward()
        with self._lock:
            self.tokens += n
            self.micro_steps += 1
            self.stats.add(stats)
        return n

    def accumulate_round(self, steps: list[MicroStep], version: int) -> list[int]:
        """:meth:`accumulate` of each of ``steps`` (a claimed group); returns their loss-token
        counts. A pipelined cell runs the group as one round of its schedule."""
        return [self.accumulate(step, version) for step in steps]

    def add_gradient(self, grads: Iterable[torch.Tensor], tokens: int, version: int) -> None:
        """Adds an externally computed gradient sum; refused unless on the window's version."""
        if self.window_version is None:
            self.open_window(version)
        if version != self.window_version:
            raise StaleGradient(f"gradient on version {version} refused: window is on {self.window_version}")
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        self.tokens += tokens

    def flat_grads(self) -> torch.Tensor:
        """Every parameter's gradient sum in one flat buffer (zeros where none)."""
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        return torch.cat(parts) if parts else torch.zeros(0)

    def close_window(self) -> None:
        """Drops the accumulated gradients and token count."""
        with self._lock:
            for p in self.params:
                p.grad = None
            self.tokens = 0
            self.micro_steps = 0
            self.window_version = None
            self.stats = LossStats()

    # Weights -------------------------------------------------------------------------

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def load_flat_params(self, flat: torch.Tensor, version: int) -> None:
        """Overwrites every trained parameter from one flat buffer (a broadcast)."""
        self._refuse_with_window_open()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
        if offset != flat.numel():
            raise InvalidArgument(f"flat params: {flat.numel()} values for {offset}")
        self.version = version

    @torch.no_grad()
    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads a pulled snapshot (names as in ``state_dict``); every parameter must be there."""
        self._refuse_with_window_open()
        own = self.model.state_dict()
        missing = [n for n in self.names if n not in state]
        if missing:
            raise InvalidArgument(f"snapshot lacks {missing[:3]}")
        for name, tensor in state.items():
            if name not in own:
                raise InvalidArgument(f"snapshot has unknown tensor {name}")
            if tuple(own[name].shape) != tuple(tensor.shape):
                raise InvalidArgument(f"{name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
            own[name].copy_(tensor.to(own[name].dtype))
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _refuse_with_window_open(self) -> None:
        if self.window_version is not None:
            raise FailedPrecondition("weights are fixed while a gradient window is open")

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt`` (for checks against the rollout engine)."""
        was = self.model.training
        self.model.eval()
        try:
            ids = torch.tensor([prompt], device=self.device)
            out: list[int] = []
            for _ in range(max_tokens):
                nxt = int(self.model(input_ids=ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]], device=self.device)], dim=1)
            return out
        finally:
            self.model.train(was)
