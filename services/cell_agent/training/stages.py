"""A pipelined cell's stage workers: one process per stage (``cell_agent.training.
pipeline_stages`` > 1), started and supervised by the cell agent, and the trainer that
drives them (:class:`PipelinedTrainer`).

**Who holds what.** The cell agent keeps the cell's registration, lease, role, claims and
the master copy of the weights with the optimizer state in host memory (as ZeRO-Offload
keeps them), so a role change is committed once for the whole cell and the checkpoint, the
write-ahead record and the snapshot served to rollout engines stay one process's, exactly
as for a one-stage cell. Each stage worker holds its stage of the layers on its device and
runs the rounds of :mod:`~services.cell_agent.training.pipeline`: the agent hands every
group of micro-steps it claims to stage 0 as one round (1F1B over the group), the stages
keep their gradient sums across rounds, and at the batch's end they drain and send them
back; the agent's gradient then goes through the prefix groups and the core's one step as a
one-stage cell's does. After each step (and after any load of weights) the agent sends
every stage its shard of the new weights before the next round.

**A stage that dies.** A worker that exits, or whose neighbour's death broke a collective,
fails the round in progress within a poll interval: the batch attempt fails with nothing
trained (its gradient is dropped, its claims go back to the packer unacknowledged or
uncommitted), the workers are restarted from the agent's weights, and the core joins the
batch again (``TrainingService``): one optimizer step for the batch, no micro-step lost.

Workers are ``python -m services.cell_agent.training.stages`` processes started through
:func:`gyre.lifeline.spawn` (they die with the agent however it dies) that connect back
over a Unix socket with an authentication key (:mod:`multiprocessing.connection`).
Tensors cross it as ``torch.save`` bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, NoReturn

import torch
from torch import nn

from gyre import lifeline
from gyre.errors import Unavailable
from gyre.failpoints import failpoint
from gyre.ports import free_port
from services.cell_agent.training.microstep import MicroStep
from services.cell_agent.training.trainer import LossConfig, LossStats, StaleGradient, Trainer, load_model

log = logging.getLogger(__name__)

AUTHKEY_ENV = "GYRE_STAGE_AUTHKEY"


class StageDied(Unavailable):
    """A stage worker exited or failed: the cell's batch attempt cannot finish."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)  # tensors, numbers, containers only


def loss_tokens(step: MicroStep) -> int:
    """The loss tokens of a micro-step as the loss counts them (token 0 is never trained)."""
    return sum(sum(s.loss_mask[1:]) for s in step.sequences)


class StageWorkers:
    """The S stage processes of one cell and their connections (blocking calls: run them in
    a thread)."""

    def __init__(
        self,
        model_dir: str,
        stages: int,
        *,
        dtype: str = "float32",
        loss: LossConfig | None = None,
        devices: Sequence[str] | None = None,
        threads: int = 1,
        backend: str = "auto",
        cell_id: str = "",
        start_timeout_s: float = 180.0,
        poll_s: float = 0.05,
    ) -> None:
        if stages < 2:
            raise ValueError("a pipelined cell has at least 2 stages")
        self.model_dir = model_dir
        self.stages = stages
        self.dtype = dtype
        self.loss = loss or LossConfig()
        self.devices = list(devices) if devices else ["cpu"] * stages
        self.threads = threads
        self.backend = backend
        self.cell_id = cell_id
        self.start_timeout_s = start_timeout_s
        self.poll_s = poll_s
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.shapes: list[list[tuple[str, tuple[int, ...]]]] = []
        """Each stage's parameters: (the full model's name, shape), in order."""
        self.failed: str | None = None
        """Why the workers can no longer run a round (a stage died), until :meth:`restart`."""
        self._following = False

    # Life ------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the S processes and waits until each has its stage built."""
        self.failed = None
        key = secrets.token_bytes(32)
        folder = tempfile.mkdtemp(prefix="gyre-stages-")
        address = os.path.join(folder, "s")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        port = free_port()
        env = {**os.environ, AUTHKEY_ENV: key.hex()}
        try:
            for s in range(self.stages):
                args = [
                    sys.executable,
                    "-m",
                    "services.cell_agent.training.stages",
                    f"--address={address}",
                    f"--index={s}",
                    f"--stages={self.stages}",
                    f"--port={port}",
                    f"--model-dir={self.model_dir}",
                    f"--dtype={self.dtype}",
                    f"--device={self.devices[s]}",
                    f"--threads={self.threads}",
                    f"--backend={self.backend}",
                ]
                self.procs.append(lifeline.spawn(args, env=env))
            by_index: dict[int, Connection] = {}
            deadline = time.monotonic() + self.start_timeout_s
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            while len(by_index) < self.stages:  # every stage connects before any builds
                if time.monotonic() > deadline:
                    raise StageDied(f"stage workers did not connect within {self.start_timeout_s:.0f} s")
                self._check_alive()
                try:
                    conn = listener.accept()
                except OSError:  # the accept's timeout: check the processes and wait again
                    continue
                by_index[conn.recv()] = conn
            self.conns = [by_index[s] for s in range(self.stages)]
            for s in range(self.stages):  # each has built its stage (the group formed)
                self.shapes.append(self._reply(s, deadline))
                self.conns[s].send(self.loss)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        log.info(
            "pipeline stages started",
            extra={"cell_id": self.cell_id, "stages": self.stages, "pids": [p.pid for p in self.procs]},
        )

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        self.shapes = []
        for conn in self.conns:  # a worker that died has closed its end
            with contextlib.suppress(OSError, EOFError, ValueError):
                conn.send(("stop",))
            conn.close()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait()
        self.procs, self.conns = [], []
        self._following = False

    def check(self) -> str | None:
        """Why the workers failed, noticing a stage that exited while none was asked
        anything (None: all alive)."""
        with contextlib.suppress(StageDied):
            self._check_alive()
        return self.failed

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # One batch -------------------------------------------------------------------------

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Every stage loads its shard of ``state`` (whole-model names)."""
        for s in range(self.stages):
            shard = {n: state[n].detach().cpu() for n, _ in self.shapes[s]}
            self._send(s, ("load", _dumps(shard)))
        for s in range(self.stages):
            self._reply(s)

    def round(self, steps: list[MicroStep], version: int) -> None:
        """One round on every stage: stage 0 announces it, the others follow."""
        if not self._following:
            for s in range(1, self.stages):
                self._send(s, ("follow",))
            self._following = True
        self._send(0, ("round", list(steps), version))
        self._reply(0)

    def drain(self) -> tuple[dict[str, torch.Tensor], int, LossStats]:
        """Closes the batch's stream (every stage drains), collects every stage's gradient
        sum by name, the batch's loss tokens and diagnostics, and forgets them on the stages."""
        if self._following:
            self._send(0, ("close",))
            for s in range(self.stages):
                self._reply(s)  # stage 0's close, the others' follow
            self._following = False
        grads: dict[str, torch.Tensor] = {}
        tokens, stats = 0, LossStats()
        for s in range(self.stages):
            self._send(s, ("grads",))
        for s in range(self.stages):
            flat, tokens, sums, peak = _loads(self._reply(s)[1])
            stats = LossStats.from_tensors(sums, peak)
            offset = 0
            for name, shape in self.shapes[s]:
                n = _numel(shape)
                grads.setdefault(name, flat[offset : offset + n].view(shape))
                offset += n
        return grads, tokens, stats

    def abandon(self) -> None:
        """Drops the open batch on every stage (a failed attempt): drains what was started
        and forgets the gradients; a failure here marks the workers failed."""
        try:
            if self._following:
                self._send(0, ("close",))
                for s in range(self.stages):
                    self._reply(s)
                self._following = False
            for s in range(self.stages):
                self._send(s, ("end",))
            for s in range(self.stages):
                self._reply(s)
        except StageDied:
            pass

    # The wire --------------------------------------------------------------------------

    def _send(self, s: int, msg: tuple[Any, ...]) -> None:
        if self.failed is not None:
            raise StageDied(self.failed)
        try:
            self.conns[s].send(msg)
        except (OSError, EOFError, ValueError) as exc:
            self._fail(f"stage {s} unreachable: {exc}")

    def _reply(self, s: int, deadline: float | None = None) -> Any:
        if self.failed is not None:
            raise StageDied(self.failed)
        conn = self.conns[s]
        try:
            while not conn.poll(self.poll_s):
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(f"stage {s} did not answer in time")
            msg = conn.recv()
        except (OSError, EOFError) as exc:
            self._check_alive()
            self._fail(f"stage {s} hung up: {exc}")
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            self._fail(f"stage {s} failed: {_last_line(msg[1])}")
        return msg

    def _check_alive(self) -> None:
        for s, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                self._fail(f"stage {s} exited with status {code}")

    def _fail(self, why: str) -> NoReturn:
        if self.failed is None:
            self.failed = why
            log.error("pipeline stage failed", extra={"cell_id": self.cell_id, "why": why})
            for p in self.procs:  # the others cannot go on without it
                if p.poll() is None:
                    p.kill()
        self._following = False
        raise StageDied(self.failed)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class PipelinedTrainer(Trainer):
    """A :class:`Trainer` whose forward and backward run on the cell's stage workers.

    The agent's model is the master copy (weights, snapshot, the core's optimizer, the
    checkpoint); the stages get its shards before a round whenever the weights changed
    (a step, a load), accumulate their gradient sums across the batch's rounds, and hand
    them back when the gradient is asked for (:meth:`flat_grads`)."""

    def __init__(
        self, model: nn.Module, version: int, loss: LossConfig | None, workers: StageWorkers
    ) -> None:
        super().__init__(model, version, loss)
        self.workers = workers
        self._synced: int | None = None
        """The weights' version the stages hold (None: they must be sent)."""
        self._open = False
        """The stages hold gradients of the open window."""
        self._by_name = dict(zip(self.names, self.params, strict=True))

    @classmethod
    def with_workers(cls, workers: StageWorkers, version: int) -> PipelinedTrainer:
        """Loads the master copy on the host and starts ``workers`` (blocking)."""
        model = load_model(workers.model_dir, workers.dtype)
        workers.start()
        return cls(model, version, workers.loss, workers)

    # Accumulation --------------------------------------------------------------------

    def accumulate(self, step: MicroStep, version: int) -> int:
        return self.accumulate_round([step], version)[0]

    def accumulate_round(self, steps: list[MicroStep], version: int) -> list[int]:
        """One round of ``steps`` through the stages (1F1B); returns each one's loss tokens.
        The gradient stays on the stages until :meth:`flat_grads`."""
        if self.window_version is None:
            self.open_window(version)
        if version != self.window_version or version != self.version:
            raise StaleGradient(f"gradient on version {version} refused: window is on {self.window_version}")
        if self._synced != self.version:
            self.workers.load(self.model.state_dict())
            self._synced = self.version
        self._open = True
        self.workers.round(steps, version)
        counts = [loss_tokens(s) for s in steps]
        with self._lock:
            self.micro_steps += len(steps)
        return counts

    def flat_grads(self) -> torch.Tensor:
        if self._open:
            grads, tokens, stats = self.workers.drain()
            self._open = False
            with torch.no_grad():
                for name, g in grads.items():
                    p = self._by_name[name]
                    p.grad = g.to(p.device, p.dtype).clone()
            with self._lock:
                self.tokens, self.stats = tokens, stats
        return super().flat_grads()

    def close_window(self) -> None:
        if self._open:
            self._open = False
            self.workers.abandon()
        super().close_window()

    # Weights -------------------------------------------------------------------------

    def load_flat_params(self, flat: torch.Tensor, version: int) -> None:
        super().load_flat_params(flat, version)
        self._synced = None

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        super().load_state(state, version)
        self._synced = None

    def restart_workers(self) -> None:
        """Replaces the stage workers (after one died): the next round sends the weights."""
        self.workers.restart()
        self._synced = None
        self._open = False

    def close(self) -> None:
        self.workers.close()


# The worker process ------------------------------------------------------------------------


def _serve(conn: Connection, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from services.cell_agent.training.pipeline import PipelineCell, StageModule, tie_groups

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backend = args.backend if args.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.index, world_size=args.stages
    )
    ranks = list(range(args.stages))
    ties = tie_groups([ranks])
    model = load_model(args.model_dir, args.dtype)
    stage = StageModule(model, args.index, args.stages)
    del model
    stage.to(device)
    stage.train()
    conn.send([(n, tuple(p.shape)) for n, p in zip(stage.names, stage.parameters(), strict=True)])
    loss: LossConfig = conn.recv()
    pc = PipelineCell(stage, ranks=ranks, group=None, tie_group=ties.get(0), loss=loss, device=device)
    forward = stage.forward

    def forward_at_failpoint(x: torch.Tensor) -> torch.Tensor:
        failpoint(f"training.stage{args.index}.forward")  # a stage dying mid-schedule (fault tests)
        return forward(x)

    stage.forward = forward_at_failpoint  # type: ignore[method-assign]
    while True:
        msg = conn.recv()
        op = msg[0]
        try:
            if op == "stop":
                break
            if op == "load":
                stage.load_shard(_loads(msg[1]))
                conn.send(("ok",))
            elif op == "round":
                pc.announce(msg[1], msg[2])
                conn.send(("ok",))
            elif op == "follow":
                while pc.follow():
                    pass
                conn.send(("ok",))
            elif op == "close":
                pc.close()
                conn.send(("ok",))
            elif op == "grads":
                sums = pc.stats.sums_tensor()
                conn.send(("grads", _dumps((stage.flat_grads().cpu(), pc.tokens, sums, pc.stats.weight_max))))
                pc.end_batch()
            elif op == "end":
                pc.end_batch()
                conn.send(("ok",))
            else:
                conn.send(("error", f"unknown command {op!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            raise
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One stage of a pipelined cell (started by its cell agent).")
    parser.add_argument("--address", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    key = bytes.fromhex(os.environ.pop(AUTHKEY_ENV, ""))
    conn = Client(args.address, family="AF_UNIX", authkey=key)
    conn.send(args.index)
    try:
        _serve(conn, args)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
