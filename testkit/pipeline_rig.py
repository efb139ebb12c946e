"""Pipelined cells in processes, as the pipeline tests and ``bench/training_pipeline.py``
run them: one process per stage over torch.distributed (gloo on CPU, NCCL on CUDA),
cells laid out rank after rank (cell ``c``'s stage ``s`` is rank ``c·S + s``; cell 0 is
the core), and the reference they are compared with, one single-stage
:class:`~services.cell_agent.training.trainer.Trainer`.

A run is described by :class:`PipelinePlan`; each rank returns its stage's names, gradient
sum and, after the core's step, its parameters (:func:`run_plan`).
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import queue
import random
import traceback
from pathlib import Path
from typing import Any

from gyre.ports import free_port
from services.cell_agent.training.microstep import MicroStep, Sequence


def micro_steps(
    count: int, *, vocab: int, seed: int = 0, rows: tuple[int, int] = (1, 3), width: tuple[int, int] = (6, 40)
) -> list[MicroStep]:
    """``count`` micro-steps of random sequences: a prompt without loss, then sampled
    tokens with behaviour log-probs, an advantage of either sign, versions lagging by 0-2."""
    rng = random.Random(seed)
    steps = []
    for i in range(count):
        seqs = []
        for j in range(rng.randint(*rows)):
            n = rng.randint(*width)
            prompt = rng.randint(1, n - 1)
            seqs.append(
                Sequence(
                    token_ids=tuple(rng.randrange(vocab) for _ in range(n)),
                    loss_mask=(0,) * prompt + (1,) * (n - prompt),
                    logprobs=(0.0,) * prompt + tuple(-rng.uniform(0.05, 4.0) for _ in range(n - prompt)),
                    advantage=rng.uniform(-1.5, 1.5),
                    execution_id=f"x{i}-{j}",
                    policy_versions=(0,) * prompt + tuple(5 - rng.randint(0, 2) for _ in range(n - prompt)),
                    temperature=rng.choice((1.0, 0.7, 0.0)),
                )
            )
        steps.append(MicroStep(f"m{i}", 1, tuple(seqs)))
    return steps


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """One batch on ``cells`` cells of ``stages`` stages each.

    ``rounds[c]``: the rounds cell ``c``'s leader announces, as lists of indexes into
    ``steps`` (every micro-step is trained by exactly one cell). ``join_after``: a
    satellite joins once the core has run that many rounds, loading its stage's shard of
    the core's weights (it starts from other weights, so a shard it failed to load shows).
    ``pause_s``: the core's leader waits this long between rounds (nothing ready)."""

    model_dir: str
    stages: int
    steps: tuple[MicroStep, ...]
    rounds: tuple[tuple[tuple[int, ...], ...], ...]
    version: int = 5
    join_after: int = 0
    pause_s: float = 0.0
    work_dir: str = ""
    """A folder the ranks share (the core's shards, its progress)."""
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    threads: int = 1
    backend: str = "gloo"
    dtype: str = "float64"
    die: tuple[int, int] | None = None
    """(rank, round): that rank SIGKILLs itself in the middle of that round's schedule (at
    its second forward of the round), as a stage process that dies mid-schedule."""

    @property
    def cells(self) -> int:
        return len(self.rounds)

    @property
    def world(self) -> int:
        return self.cells * self.stages


def run_plan(plan: PipelinePlan, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Runs ``plan`` in ``plan.world`` processes; returns each rank's result in rank order.
    Raises if a rank fails or the run outlives ``timeout_s``."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(plan, rank, port, out), daemon=True)
        for rank in range(plan.world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    living = plan.world - (1 if plan.die else 0)
    try:
        while len(results) < living:
            try:
                rank, result = out.get(timeout=timeout_s)
            except queue.Empty as exc:
                raise TimeoutError(
                    f"pipeline ranks {sorted(set(range(plan.world)) - set(results))} hung"
                ) from exc
            if isinstance(result, dict):
                raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
            results[rank] = _load(result)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if plan.die:
        procs[plan.die[0]].join(timeout=10)
        results[plan.die[0]] = {"rank": plan.die[0], "exitcode": procs[plan.die[0]].exitcode}
    return [results[r] for r in range(plan.world)]


def _load(data: bytes) -> dict[str, Any]:
    import torch

    return torch.load(io.BytesIO(data))


def _rank_main(plan: PipelinePlan, rank: int, port: int, out: Any) -> None:
    import torch

    try:
        buf = io.BytesIO()
        torch.save(_rank(plan, rank, port), buf)  # as bytes: a tensor's shared memory dies with its process
        out.put((rank, buf.getvalue()))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))


def _rank(plan: PipelinePlan, rank: int, port: int) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from services.cell_agent.training.core import OptimConfig
    from services.cell_agent.training.pipeline import (
        PipelineCell,
        StageModule,
        StageOptimizer,
        reduce_to_core,
        tie_groups,
    )

    torch.set_num_threads(plan.threads)
    S, cell, index = plan.stages, rank // plan.stages, rank % plan.stages
    device = (
        torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if plan.backend == "nccl" else None
    )
    dist.init_process_group(
        plan.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=plan.world
    )
    cells = [[c * S + s for s in range(S)] for c in range(plan.cells)]
    cell_groups = [dist.new_group(r) for r in cells]
    stage_groups = [dist.new_group([c * S + s for c in range(plan.cells)]) for s in range(S)]
    ties = tie_groups(cells)
    model = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=getattr(torch, plan.dtype))
    model.config.attention_dropout = 0.0
    if cell > 0:  # a satellite starts from other weights: what it trains on comes from the core
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    stage = StageModule(model, index, S)
    del model
    if device is not None:
        stage.to(device)
    pc = PipelineCell(
        stage, ranks=cells[cell], group=cell_groups[cell], tie_group=ties.get(cells[cell][0]), device=device
    )
    if plan.die and plan.die[0] == rank:
        _die_in_round(stage, pc, plan.die[1])
    core_rank = index  # the core's stage s
    # The core's stages expose the batch's weights, one shard per stage (its snapshot); a
    # satellite's stage loads only its own stage's shard when it joins.
    work = Path(plan.work_dir)
    shard_path = work / f"shard-{index}.pt"
    if cell == 0:
        torch.save(stage.shard(), work / f"shard-{index}.tmp")
        os.replace(work / f"shard-{index}.tmp", shard_path)
    else:
        _wait_for(shard_path)
        stage.load_shard(torch.load(shard_path))
        if index == 0 and plan.join_after:
            _wait_for(work / f"core-rounds-{plan.join_after}")
    t0 = time.perf_counter()
    try:
        drain_s = _stream(plan, pc, cell, index, work)
    except (RuntimeError, OSError) as exc:  # a stage died: this one fails, not hangs
        grads = [p.grad for p in stage.parameters() if p.grad is not None]
        return {
            "rank": rank,
            "failed": f"{type(exc).__name__}: {exc}",
            "grads_left": len(grads),
            "after_s": time.perf_counter() - t0,
        }
    wall = time.perf_counter() - t0
    grad = reduce_to_core(pc, core_rank, stage_groups[index] if plan.cells > 1 else None)
    result: dict[str, Any] = {
        "rank": rank,
        "cell": cell,
        "stage": index,
        "names": list(stage.names),
        "grad": grad,
        "tokens": pc.tokens,
        "stats": dataclasses.asdict(pc.stats),
        "times": dataclasses.asdict(pc.times),
        "wall_s": wall,
        "drain_s": drain_s,
    }
    if cell == 0:
        opt = StageOptimizer(pc, OptimConfig(lr=plan.lr, max_grad_norm=plan.max_grad_norm))
        result["grad_norm"] = opt.step(grad, pc.tokens)
        result["params"] = {n: t.detach().cpu().clone() for n, t in stage.shard().items()}
    pc.end_batch()
    dist.barrier()
    dist.destroy_process_group()
    return result


def _stream(plan: PipelinePlan, pc: Any, cell: int, index: int, work: Path) -> float:
    """The batch's stream on one stage: the leader announces the cell's rounds and closes,
    the others follow; returns the leader's drain time."""
    import time

    if index != 0:
        while pc.follow():
            pass
        return 0.0
    for r in plan.rounds[cell]:
        if cell == 0 and plan.pause_s and pc.times.rounds:
            time.sleep(plan.pause_s)
        pc.announce([plan.steps[i] for i in r], plan.version)
        if cell == 0:
            (work / f"core-rounds-{pc.times.rounds}").touch()
    drain0 = time.perf_counter()
    pc.close()
    return time.perf_counter() - drain0


def _die_in_round(stage: Any, pc: Any, round_index: int) -> None:
    """SIGKILLs this process at its second forward of round ``round_index``."""
    import signal

    forward = stage.forward
    calls = [0]

    def dying(x: Any) -> Any:
        if pc.times.rounds == round_index:
            calls[0] += 1
            if calls[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return forward(x)

    stage.forward = dying


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def reference(plan: PipelinePlan) -> dict[str, Any]:
    """The same batch trained by one single-stage cell: per-name gradient sums, tokens, and
    the parameters after one core step (:class:`~.core.CoreOptimizer`)."""
    import torch

    from services.cell_agent.training.core import CoreOptimizer, OptimConfig
    from services.cell_agent.training.trainer import Trainer

    trainer = Trainer.from_dir(plan.model_dir, plan.version, dtype="float64")
    for i in sorted(i for rounds in plan.rounds for r in rounds for i in r):
        trainer.accumulate(plan.steps[i], plan.version)
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in zip(trainer.names, trainer.params, strict=True)
    }
    tokens = trainer.tokens
    core = CoreOptimizer(trainer, OptimConfig(lr=plan.lr, max_grad_norm=plan.max_grad_norm))
    result = core.step(1, trainer.flat_grads(), tokens)
    params = {n: p.detach().clone() for n, p in zip(trainer.names, trainer.params, strict=True)}
    return {"grads": grads, "tokens": tokens, "params": params, "grad_norm": result.grad_norm}


def split_by_name(results: list[dict[str, Any]], cell: int = 0) -> dict[str, Any]:
    """The core's (``cell``'s) stages' flat gradients cut back into tensors by name; a name
    on two stages (tied embeddings) must carry the same summed gradient on both."""
    import torch

    out: dict[str, Any] = {}
    for r in results:
        if r["cell"] != cell:
            continue
        offset = 0
        for name, p in r["params"].items() if "params" in r else []:
            n = p.numel()
            g = r["grad"][offset : offset + n].view_as(p)
            offset += n
            if name in out:
                assert torch.equal(out[name], g), f"tied {name} differs between stages"
            out[name] = g
    return out


def model_dir_with(base: Path, layers: int) -> Path:
    """The tiny model with ``layers`` decoder layers, built once under ``base``."""
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(base / f"tiny-{layers}l", num_hidden_layers=layers)
