"""A cell of S stages: the causal LM cut by layer into S stages, one process per device,
trained by ``torch.distributed.pipelining``'s one-forward-one-backward schedule.

**Rounds.** The packer streams a batch's micro-steps as its groups become ready: one at a
time, unevenly, with gaps. torch's schedules run a fixed list of micro-batches of one shape
(their receive buffers are sized from the first). The cell's leader, stage 0 (the process
that claims from the packer), therefore takes the micro-steps that are ready as one
*round*, pads them to one shape and announces the round to the other stages over the
cell's group; every stage then runs the round's 1F1B schedule (GPipe's when the round has
fewer micro-steps than stages: 1F1B needs at least one per stage).

**Pause and drain.** A schedule returns only after every send it posted has completed, so
between rounds no micro-step is half done and nothing is in flight. That is where the
stages wait while no micro-step is ready: blocked on the leader's next announcement. The
leader announces the stream's close the same way, and each stage drains: the tied
embedding's gradient is summed between the first and the last stage and the token count
and loss diagnostics (known to the last stage) are shared with the others, so each stage
can reduce its gradient to the core's same stage (:func:`reduce_to_core`).

**Stages across cells.** Stage ``s`` of every cell in a batch reduces its gradient sum to
stage ``s`` of the core over that stage's group, and a satellite joining mid-batch loads
only its stage's shard of the core's snapshot (:meth:`StageModule.shard`). The core's
stages take one AdamW step per batch together (:class:`StageOptimizer`): the gradient norm
they clip by is the whole model's, summed across stages.

Gradients are *sums* over loss tokens here as in :class:`~.trainer.Trainer`
(``scale_grads=False``), so a batch split across cells, stages and rounds adds up to the
same gradient as one cell training it alone.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gyre.errors import InvalidArgument
from services.cell_agent.training.core import OptimConfig
from services.cell_agent.training.microstep import MicroStep
from services.cell_agent.training.trainer import LossConfig, LossStats, TokenTargets, target_losses

TARGET_FIELDS = ("ids", "mask", "behav", "lag", "adv", "temp")
"""The channels of a round's target tensor [n·R, W, 6] (float64; adv and temp repeated
along W), what the last stage's loss needs."""


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """The decoder layers ``[lo, hi)`` of each stage: an even split, earlier stages taking
    one more where it does not divide (the first and last also hold the embedding and the
    head)."""
    if not 1 <= stages <= num_layers:
        raise InvalidArgument(f"{stages} stages for {num_layers} layers: need 1 <= stages <= layers")
    base, extra = divmod(num_layers, stages)
    bounds, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class StageModule(nn.Module):
    """Stage ``index`` of ``stages`` of a transformers decoder-only causal LM (``model.model``
    with ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``; ``model.lm_head``).

    Stage 0 takes token ids, the others the previous stage's hidden states; the last returns
    logits. ``names`` are the full model's names of this stage's parameters, in order: with
    tied embeddings the first and the last stage both hold ``model.embed_tokens.weight``.
    """

    def __init__(self, model: Any, index: int, stages: int) -> None:
        super().__init__()
        inner = model.model
        self.config: Any = model.config
        lo, hi = stage_bounds(int(self.config.num_hidden_layers), stages)[index]
        self.index, self.stages = index, stages
        self.first, self.last = index == 0, index == stages - 1
        self.embed_tokens: nn.Module | None = inner.embed_tokens if self.first else None
        self.layers = nn.ModuleList(list(inner.layers)[lo:hi])
        self.rotary_emb: nn.Module = inner.rotary_emb
        self.norm: nn.Module | None = inner.norm if self.last else None
        self.lm_head: nn.Module | None = model.lm_head if self.last else None
        full = {id(p): n for n, p in model.named_parameters()}
        self.names = [full[id(p)] for p in self.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos
        )
        pe = self.rotary_emb(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        if self.lm_head is not None and self.norm is not None:
            return self.lm_head(self.norm(h))
        return h

    def shard(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under the full model's names (what a joining satellite's
        same stage pulls from the core)."""
        return {n: p.detach() for n, p in zip(self.names, self.parameters(), strict=True)}

    @torch.no_grad()
    def load_shard(self, state: Mapping[str, torch.Tensor]) -> None:
        """Loads this stage's parameters from ``state`` (a shard or a whole snapshot)."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise InvalidArgument(f"shard lacks {missing[:3]}")
        for n, p in zip(self.names, self.parameters(), strict=True):
            if tuple(state[n].shape) != tuple(p.shape):
                raise InvalidArgument(f"{n}: shape {tuple(state[n].shape)} != {tuple(p.shape)}")
            p.copy_(state[n].to(p.dtype))

    def flat_grads(self) -> torch.Tensor:
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.parameters()
        ]
        return torch.cat(parts)

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.parameters():
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n


def round_tensors(
    steps: list[MicroStep], version: int | None, rows: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-steps of a round padded to [rows, width] each and stacked: the input ids
    [n·rows, width] and the target [n·rows, width, 6] (:data:`TARGET_FIELDS`). Padding rows
    have no loss tokens."""
    ids, targets = [], []
    for step in steps:
        seqs = list(step.sequences)
        t = TokenTargets.of(seqs, version, width, torch.float64)
        pad = rows - len(seqs)
        row = torch.stack(
            [
                t.ids.double(),
                t.mask,
                t.behav,
                t.lag.double(),
                t.adv[:, None].expand(-1, width),
                t.temp[:, None].expand(-1, width),
            ],
            dim=-1,
        )
        if pad:
            filler = torch.zeros(pad, width, len(TARGET_FIELDS), dtype=torch.float64)
            filler[..., 5] = 1.0  # temperature 1 (nothing is scored on these rows)
            row = torch.cat([row, filler])
        targets.append(row)
        ids.append(row[..., 0].long())
    return torch.cat(ids), torch.cat(targets)


def unpack_targets(target: torch.Tensor, dtype: torch.dtype) -> TokenTargets:
    return TokenTargets(
        ids=target[..., 0].long(),
        mask=target[..., 1].to(dtype),
        behav=target[..., 2].to(dtype),
        lag=target[..., 3].long(),
        adv=target[:, 0, 4].to(dtype),
        temp=target[:, 0, 5].to(dtype),
    )


@dataclasses.dataclass
class RoundTimes:
    """Where a stage's time went: ``busy_s`` in forward, backward and loss work, per round
    as well (``round_busy_s``), and ``pause_s`` waiting for the leader's announcements. A
    round's bubble on a stage is ``1 - busy / span``, the span running from the first
    stage's start to the last one's end (``round_span``)."""

    rounds: int = 0
    micro_steps: int = 0
    busy_s: float = 0.0
    pause_s: float = 0.0
    resume_s: list[float] = dataclasses.field(default_factory=list)
    """Per round, from the leader's announcement to this stage's schedule starting."""
    round_busy_s: list[float] = dataclasses.field(default_factory=list)
    round_span: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """Per round, this stage's schedule start and end on the machine's monotonic clock
    (a pipeline's bubble is measured against the span from the first stage's start to the
    last one's end)."""


class _TimedStage(PipelineStage):
    """torch's stage with the time of its forward and backward work counted."""

    times: RoundTimes

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._busy(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._busy(super().backward_one_chunk, *args, **kwargs)

    def _busy(self, work: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            self.times.busy_s += time.perf_counter() - t0


class PipelineCell:
    """One stage's process of a pipelined cell: runs the rounds the leader announces and
    accumulates this stage's gradient sum for the open batch.

    ``ranks``: the global ranks of the cell's stages in order (stage 0 first); ``group``:
    the cell's process group over them (gloo on CPU, NCCL on CUDA: the same code path).
    """

    def __init__(
        self,
        stage: StageModule,
        *,
        ranks: list[int],
        group: dist.ProcessGroup | None,
        tie_group: dist.ProcessGroup | None = None,
        loss: LossConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        if len(ranks) != stage.stages:
            raise InvalidArgument(f"{len(ranks)} ranks for {stage.stages} stages")
        if stage.stages > 1 and (stage.first or stage.last) and tied(stage.config) and tie_group is None:
            raise InvalidArgument("a pipelined model with tied embeddings needs its tie group (tie_groups)")
        self.stage = stage
        self.ranks = ranks
        self.group = group
        self.tie_group = tie_group
        """The first and the last stage's group (tied embeddings; see :func:`tie_groups`)."""
        self.loss = loss or LossConfig()
        self.device = device or torch.device("cpu")
        self.dtype = next(stage.parameters()).dtype
        self.tokens = 0
        self.stats = LossStats()
        self.times = RoundTimes()
        self._version: int | None = None
        for p in stage.parameters():
            p.grad = None

    @property
    def index(self) -> int:
        return self.stage.index

    @property
    def stages(self) -> int:
        return self.stage.stages

    # The leader's side -----------------------------------------------------------------

    def announce(self, steps: list[MicroStep], version: int) -> None:
        """Stage 0: runs ``steps`` as one round on every stage of the cell."""
        if self.index != 0:
            raise InvalidArgument("only stage 0 announces rounds")
        if not steps:
            raise InvalidArgument("a round needs at least one micro-step")
        if self._version not in (None, version):  # before the others hear of the round
            raise InvalidArgument(f"round on version {version} in a batch on {self._version}")
        rows = max(len(s.sequences) for s in steps)
        width = max(len(q.token_ids) for s in steps for q in s.sequences)
        ids, target = round_tensors(steps, version, rows, width)
        now_us = int(time.monotonic() * 1e6)
        self._broadcast(torch.tensor([len(steps), rows, width, version, 0, now_us], dtype=torch.long))
        self._broadcast(target)
        self._run(len(steps), ids, target, version)

    def close(self) -> None:
        """Stage 0: the batch's stream closed; every stage drains (:meth:`drain`)."""
        if self.index != 0:
            raise InvalidArgument("only stage 0 closes the stream")
        self._broadcast(torch.tensor([0, 0, 0, 0, 1, 0], dtype=torch.long))
        self.drain()

    # The other stages' side ------------------------------------------------------------

    def follow(self) -> bool:
        """Stages 1..S-1: waits for the leader's next announcement (the pause) and runs the
        round; on the stream's close drains and returns False."""
        t0 = time.perf_counter()
        header = self._broadcast(torch.zeros(6, dtype=torch.long))
        n, rows, width, version, closed, announced_us = (int(x) for x in header.tolist())
        if closed:
            self.times.pause_s += time.perf_counter() - t0
            self.drain()
            return False
        target = self._broadcast(torch.zeros(n * rows, width, len(TARGET_FIELDS), dtype=torch.float64))
        self.times.pause_s += time.perf_counter() - t0
        self.times.resume_s.append(time.monotonic() - announced_us / 1e6)
        self._run(n, target[..., 0].long(), target, version)
        return True

    # Every stage -----------------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.stages > 1:
            t = t.to(self.device)
            dist.broadcast(t, src=self.ranks[0], group=self.group)
            t = t.cpu()
        return t

    def _run(self, n: int, ids: torch.Tensor, target: torch.Tensor, version: int) -> None:
        if self._version not in (None, version):
            raise InvalidArgument(f"round on version {version} in a batch on {self._version}")
        self._version = version
        start = time.monotonic()
        if self.stages == 1:
            self._run_alone(n, ids, target)
        else:
            rows, width = ids.shape[0] // n, ids.shape[1]
            pstage = _TimedStage(
                self.stage,
                self.index,
                self.stages,
                self.device,
                input_args=self._activation(rows, width, self.stage.first),
                output_args=self._activation(rows, width, False, logits=self.stage.last),
                group=self.group,
            )
            pstage.times = self.times
            schedule = Schedule1F1B if n >= self.stages else ScheduleGPipe
            sched = schedule(pstage, n, loss_fn=self._loss_fn, scale_grads=False)
            args = (ids.to(self.device),) if self.index == 0 else ()
            tgt = target.to(self.device) if self.stage.last else None
            try:
                sched.step(*args, target=tgt, return_outputs=False)
            except BaseException:
                # A neighbour died or the group broke mid-schedule: the batch cannot finish
                # on this cell, so nothing of it stays (its claims go back unacknowledged).
                self.end_batch()
                raise
        self.times.round_span.append((start, time.monotonic()))
        self.times.round_busy_s.append(self.times.busy_s - sum(self.times.round_busy_s))
        self.times.rounds += 1
        self.times.micro_steps += n

    def _activation(self, rows: int, width: int, ids: bool, logits: bool = False) -> torch.Tensor:
        """The shape of what a stage takes or gives for one micro-step (token ids, hidden
        states or logits), given to torch up front: without it, torch infers the shapes by
        running each round's first micro-step an extra time, loss included."""
        if ids:
            return torch.empty(rows, width, dtype=torch.long, device="meta")
        last = int(self.stage.config.vocab_size if logits else self.stage.config.hidden_size)
        return torch.empty(rows, width, last, dtype=self.dtype, device="meta", requires_grad=True)

    def _run_alone(self, n: int, ids: torch.Tensor, target: torch.Tensor) -> None:
        for x, t in zip(ids.chunk(n), target.chunk(n), strict=True):
            t0 = time.perf_counter()
            loss = self._loss_fn(self.stage(x.to(self.device)), t.to(self.device))
            loss.backward()
            self.times.busy_s += time.perf_counter() - t0

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss, n, stats = target_losses(logits, unpack_targets(target, _loss_dtype(logits)), self.loss)
        self.tokens += n
        self.stats.add(stats)
        if self.stages > 1:  # alone, _run_alone counts the whole micro-step
            self.times.busy_s += time.perf_counter() - t0
        return loss

    def drain(self) -> None:
        """Ends the batch's stream on this stage: the tied embedding's two halves get their
        summed gradient, and every stage learns the batch's loss tokens and diagnostics."""
        if self.stages > 1:
            tied = self._tied_parameter()
            if tied is not None:
                g = tied.grad if tied.grad is not None else torch.zeros_like(tied)
                g = g.contiguous()
                dist.all_reduce(g, group=self.tie_group)
                tied.grad = g
            last = self.ranks[-1]
            head, peak = self.header()
            self.take_header(self._bcast_from(head, last), self._bcast_from(peak, last))

    def header(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's [tokens, loss sums] (added across stages' cells) and [largest behaviour
        weight] (the maximum), on this stage's device."""
        head = torch.cat([torch.tensor([float(self.tokens)], dtype=torch.float64), self.stats.sums_tensor()])
        peak = torch.tensor([self.stats.weight_max], dtype=torch.float64)
        return head.to(self.device), peak.to(self.device)

    def take_header(self, head: torch.Tensor, peak: torch.Tensor) -> None:
        self.tokens = int(head[0].item())
        self.stats = LossStats.from_tensors(head[1:].cpu(), float(peak[0].item()))

    def _bcast_from(self, t: torch.Tensor, src: int) -> torch.Tensor:
        t = t.to(self.device)
        dist.broadcast(t, src=src, group=self.group)
        return t.cpu()

    def _tied_parameter(self) -> nn.Parameter | None:
        """The parameter the first and the last stage share (tied embeddings), on those two."""
        if not (self.stage.first or self.stage.last) or not tied(self.stage.config):
            return None
        module = self.stage.embed_tokens if self.stage.first else self.stage.lm_head
        assert module is not None
        return module.weight  # type: ignore[return-value]

    def end_batch(self) -> None:
        """Forgets the batch's gradient, tokens and diagnostics (after the step)."""
        for p in self.stage.parameters():
            p.grad = None
        self.tokens = 0
        self.stats = LossStats()
        self._version = None


def tie_groups(cells: list[list[int]]) -> dict[int, dist.ProcessGroup]:
    """The group of each cell's first and last stage, for the tied embedding's gradient, by
    the cell's first rank. Call it on every rank: ``new_group`` is collective over the
    default group."""
    return {ranks[0]: dist.new_group([ranks[0], ranks[-1]]) for ranks in cells if len(ranks) > 1}


def tied(config: Any) -> bool:
    """The model's input embedding and output head share their weights."""
    return bool(getattr(config, "tie_word_embeddings", False))


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    # The loss in at least float32 (bf16 log-softmax over a vocabulary is too coarse).
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def reduce_to_core(cell: PipelineCell, core_rank: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Stage ``s`` of a participating cell reduces its gradient sum, token count and loss
    sums to stage ``s`` of the core over that stage's group (``group``: None, the core
    trained alone). Returns the flat gradient sum (on the core: everyone's)."""
    grad = cell.stage.flat_grads().contiguous().to(cell.device)
    if group is None:
        return grad.cpu()
    head, peak = cell.header()
    dist.reduce(grad, dst=core_rank, group=group)
    dist.reduce(head, dst=core_rank, group=group)
    dist.reduce(peak, dst=core_rank, group=group, op=dist.ReduceOp.MAX)
    if dist.get_rank() == core_rank:
        cell.take_header(head, peak)
    return grad.cpu()


class StageOptimizer:
    """AdamW over one core stage's parameters. The core's stages step together: the
    gradient norm they clip by is the whole model's (each stage's squares summed over the
    cell's group, the tied embedding counted once), as one optimizer over the whole model
    would clip."""

    def __init__(self, cell: PipelineCell, cfg: OptimConfig) -> None:
        self.cell = cell
        self.cfg = cfg
        self.params = list(cell.stage.parameters())
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
        )

    def step(self, grad_sum: torch.Tensor, tokens: int) -> float:
        """Normalizes ``grad_sum`` by the batch's ``tokens``, clips by the whole model's norm
        and steps once; returns that norm (0 and no step when there were no tokens)."""
        if tokens <= 0:
            self.opt.zero_grad(set_to_none=True)
            return 0.0
        stage = self.cell.stage
        stage.set_flat_grads(grad_sum.to(self.params[0].device) / tokens)
        # The tied embedding's gradient is on the first and the last stage: count it once.
        twice = self.cell._tied_parameter() if stage.last and not stage.first else None
        squares = sum(
            float(p.grad.double().pow(2).sum()) for p in self.params if p.grad is not None and p is not twice
        )
        total = torch.tensor([squares], dtype=torch.float64, device=self.cell.device)
        if self.cell.stages > 1:
            dist.all_reduce(total, group=self.cell.group)
        norm = math.sqrt(float(total[0].item()))
        coef = min(1.0, self.cfg.max_grad_norm / (norm + 1e-6))
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm
