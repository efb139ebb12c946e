"""The per-cell trainer: the causal LM, the clipped policy-gradient token loss, and the
gradient accumulator that sums token-loss gradients on exactly one weight version.

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


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """PPO-clip / GRPO token loss: ``-min(r A, clip(r, 1-lo, 1+hi) A)`` per loss token."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2


def token_losses(logits: torch.Tensor, seqs: list[Sequence], cfg: LossConfig) -> tuple[torch.Tensor, int]:
    """Sum of the clipped policy-gradient losses of every loss token of ``seqs`` (padded
    right into ``logits`` [B, T, V]) and the number of loss tokens."""
    device = logits.device
    # The loss in at least float32 (bf16 log-softmax over a vocabulary is too coarse).
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    b, t = logits.shape[0], logits.shape[1]
    ids = torch.zeros(b, t, dtype=torch.long, device=device)
    mask = torch.zeros(b, t, dtype=dtype, device=device)
    old = torch.zeros(b, t, dtype=dtype, device=device)
    adv = torch.tensor([s.advantage for s in seqs], dtype=dtype, device=device)
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, device=device)
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=dtype, device=device)
        old[i, :n] = torch.tensor(s.logprobs, dtype=dtype, device=device)
    # Token j is predicted from the logits at j-1: position 0 is never trained.
    logp = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    m, old = mask[:, 1:], old[:, 1:]
    ratio = torch.exp((logp - old) * m)  # masked positions: ratio 1, loss multiplied by 0
    a = adv[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * a
    loss = -torch.minimum(unclipped, clipped) * m
    return loss.sum(), int(m.sum().item())


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
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
        model.to(device)  # type: ignore[arg-type]  # transformers' decorator types `to` oddly
        # Dropout off: gradients must not depend on which cell computes a micro-step.
        model.config.attention_dropout = 0.0
        return cls(model, version, loss)

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
        loss, n = token_losses(logits, seqs, self.loss)
        if n:
            loss.backward()
        with self._lock:
            self.tokens += n
            self.micro_steps += 1
        return n

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
