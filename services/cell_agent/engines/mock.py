"""The mock engine: the Engine interface with a timing model instead of a network.

It batches like a real engine (one step emits one token for every running request, new
requests are prefilled in the step that admits them), charges each step the cost the
:class:`MockTiming` roofline model gives (defaults: a 7B model on an H200, from
``docs/design/workloads.md``), and sleeps that long on an injectable :class:`Clock` (scaled by
``time_scale``; a :class:`VirtualClock` makes tests exact and instant).

Tokens are deterministic: token ``i`` is a hash of the weights' fingerprint and the last
``window`` tokens of the context (and, when sampled at a temperature > 0, of the request's
seed, or of the engine's ``sampling_seed`` for a request without one), so a continuation
from prompt + k generated tokens yields exactly the tokens an uninterrupted run would have
produced. Log-probs are the emitted token's under a model distribution derived from the
same hash and tempered like the real engine's (see :func:`mock_logprob`). Weights are
fingerprinted by content, so restoring old weights restores old output. KV export/import
pins a request's context under a handle (in memory, or as a file when ``kv_dir`` is set)
and lets another mock engine skip prefilling it. Faults are scriptable (die after k
tokens, hang after k tokens) for fault tests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from gyre.errors import FailedPrecondition
from services.cell_agent.engines.base import (
    Chunk,
    Engine,
    EngineDead,
    FinishReason,
    KvHandle,
    Sampling,
    Weights,
)

log = logging.getLogger(__name__)

_MEMORY_KV: dict[str, tuple[bytes, list[int]]] = {}
"""In-process KV handles (medium "memory"): handle id -> (weights fingerprint, tokens)."""


class Clock(Protocol):
    """Time source of the mock: ``now()`` in seconds and an awaitable ``sleep``."""

    def now(self) -> float: ...

    async def sleep(self, dt: float) -> None: ...


class RealClock:
    """Wall-clock time (monotonic) and asyncio sleeps."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, dt: float) -> None:
        await asyncio.sleep(max(dt, 0.0))


class VirtualClock:
    """Virtual time: ``sleep`` advances the clock at once (and yields to the loop)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    async def sleep(self, dt: float) -> None:
        self.t += max(dt, 0.0)
        await asyncio.sleep(0)


@dataclasses.dataclass(frozen=True)
class MockTiming:
    """Roofline cost model of one engine step (defaults: 7B on an H200, docs/design/workloads.md).

    decode term = max((weights + sum(ctx) * kv_bytes) / (bw_eff * HBM_BW),
                      2 * N * B / (flop_eff * FLOPS))
    prefill     = new_tokens * (2N + 4 * L * d * mean_ctx) / (flop_eff * FLOPS)
    step        = overhead + sum(prefill of admitted requests) + decode term (if decoding)
    All durations are multiplied by ``time_scale`` (0: no waiting at all).
    """

    n_params: float = 7.0e9
    weight_bytes: float = 14.0e9
    n_layers: int = 28
    d_model: int = 3584
    kv_bytes_per_token: float = 57344.0
    hbm_bytes_per_s: float = 4.8e12
    flops: float = 989e12
    bw_efficiency: float = 0.8
    flop_efficiency: float = 0.5
    step_overhead_s: float = 0.003
    fixed_decode_step_s: float = 0.0
    """When > 0, the decode term is this constant instead of the roofline (a simple
    per-token delay, e.g. for the walking skeleton)."""
    weight_load_s: float = 0.1
    sleep_s: float = 0.5
    wake_s: float = 0.5
    time_scale: float = 1.0

    def decode_term_s(self, contexts: list[int]) -> float:
        if not contexts:
            return 0.0
        if self.fixed_decode_step_s > 0:
            return self.fixed_decode_step_s
        bw = (self.weight_bytes + sum(contexts) * self.kv_bytes_per_token) / (
            self.bw_efficiency * self.hbm_bytes_per_s
        )
        compute = 2.0 * self.n_params * len(contexts) / (self.flop_efficiency * self.flops)
        return max(bw, compute)

    def prefill_s(self, new_tokens: int, start_ctx: int) -> float:
        if new_tokens <= 0:
            return 0.0
        mean_ctx = start_ctx + new_tokens / 2.0
        per_token = 2.0 * self.n_params + 4.0 * self.n_layers * self.d_model * mean_ctx
        return new_tokens * per_token / (self.flop_efficiency * self.flops)

    def step_s(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """Unscaled cost of one step: ``prefills`` are (new tokens, cached tokens) of the
        requests admitted in it, ``decode_contexts`` the context lengths of the others."""
        return (
            self.step_overhead_s
            + sum(self.prefill_s(n, c) for n, c in prefills)
            + self.decode_term_s(decode_contexts)
        )


@dataclasses.dataclass
class MockFaults:
    """Scripted faults. Counts are of generated (non-probe) tokens, over all requests."""

    die_after_tokens: int = -1
    """The engine dies once this many tokens were generated (-1: never)."""
    hang_after_tokens: int = -1
    """The engine stops making progress once this many tokens were generated (-1: never)."""


@dataclasses.dataclass
class MockStats:
    """Counters for benchmarks and tests."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    kv_imports: int = 0
    kv_import_misses: int = 0
    busy_s: float = 0.0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    context: list[int]
    prompt_len: int
    sampling: Sampling
    queue: asyncio.Queue[Chunk | BaseException]
    cached: int = 0
    generated: int = 0
    prefilled: bool = False
    probe: bool = False

    @property
    def ctx(self) -> int:
        return len(self.context)


class MockEngine(Engine):
    """A deterministic engine with a timing model (see the module docstring)."""

    kind = "mock"

    def __init__(
        self,
        timing: MockTiming | None = None,
        clock: Clock | None = None,
        faults: MockFaults | None = None,
        vocab_size: int = 512,
        token_floor: int = 3,
        window: int = 8,
        max_batch: int = 256,
        seed: int = 0,
        model_dir: str = "",
        cell_id: str = "mock",
        kv_dir: str = "",
        kv_pin_ttl_s: float = 30.0,
        prefix_cache_tokens: int = 1 << 20,
        block_tokens: int = 16,
        policy_version: int = 0,
        sampling_seed: int = 0,
    ) -> None:
        """``seed`` names the mock's model (its fingerprint when ``model_dir`` holds no
        weights); ``sampling_seed`` is the engine's own random stream: what a request sampled
        without a seed of its own draws from (the cell's ``engine_seed``)."""
        super().__init__(policy_version)
        if vocab_size <= token_floor:
            raise ValueError("vocab_size must exceed token_floor")
        self.timing = timing or MockTiming()
        self.clock: Clock = clock or RealClock()
        self.faults = faults or MockFaults()
        self.stats = MockStats()
        self._vocab = vocab_size
        self._floor = token_floor
        self._window = window
        self._max_batch = max_batch
        self._seed = seed
        self._sampling_salt = struct.pack("<q", sampling_seed)
        """What a sampled request without a seed of its own is salted with (the engine's own
        random stream, as vLLM's global seed; 0: the salt of request seed 0, as before)."""
        self._model_dir = model_dir
        self._cell_id = cell_id
        self._kv_dir = kv_dir
        self._block = block_tokens
        self._cache_capacity_blocks = max(prefix_cache_tokens // block_tokens, 0)
        self._prefix_cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._fingerprint = hashlib.blake2b(f"gyre-mock-{seed}".encode(), digest_size=16).digest()
        self._requests: dict[str, _Request] = {}
        self._order: collections.deque[_Request] = collections.deque()
        self._wakeup = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._kv_handles: dict[str, str] = {}  # handle id -> file path or "" (memory)
        # As vLLM's pins (VllmEngine.kv_pin_ttl_s): a handle nobody imports or releases (its
        # router died between the export and the hand-off) is dropped, not kept for good.
        self._kv_pin_ttl_s = kv_pin_ttl_s
        self._kv_expiry: dict[str, asyncio.TimerHandle] = {}

    @property
    def kv_tokens(self) -> int:
        """The prefix cache's capacity: where the timing model keeps the mock's KV."""
        return self._cache_capacity_blocks * self._block

    # Lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        weights = Path(self._model_dir) / "model.safetensors" if self._model_dir else None
        if weights is not None and weights.exists():
            self._fingerprint = await asyncio.to_thread(fingerprint_weights, weights.read_bytes())
        self._loop_task = asyncio.create_task(self._run(), name=f"mock-engine-{self._cell_id}")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for req in list(self._requests.values()):
            self._finish(req, Chunk([], [], self._policy_version, FinishReason.ABORT))
        for handle in list(self._kv_handles):
            await self.release_kv(handle)

    @property
    def fingerprint(self) -> bytes:
        """Content hash of the loaded weights (tokens depend on it)."""
        return self._fingerprint

    # Serving -------------------------------------------------------------------------------

    async def _generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Sampling, kv_handle: KvHandle | None
    ) -> AsyncIterator[Chunk]:
        if request_id in self._requests:
            raise FailedPrecondition(f"request {request_id} is already running")
        req = _Request(
            request_id,
            list(prompt_token_ids),
            len(prompt_token_ids),
            sampling,
            asyncio.Queue(),
            probe=request_id.startswith("probe-"),
        )
        req.cached = self._cached_prefix(prompt_token_ids, kv_handle)
        self._requests[request_id] = req
        self._order.append(req)
        self._wakeup.set()
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # Coalesce what piled up while the consumer was busy into one chunk.
                while item.finish_reason is None and not req.queue.empty():
                    nxt = req.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = Chunk(
                        item.token_ids + nxt.token_ids,
                        item.logprobs + nxt.logprobs,
                        nxt.policy_version,
                        nxt.finish_reason,
                    )
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer gone (cancelled, closed) or stream over: the request leaves the engine.
            self._drop(req)

    async def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, Chunk([], [], self._policy_version, FinishReason.ABORT))
        return True

    @property
    def running_requests(self) -> int:
        return sum(1 for r in self._requests.values() if not r.probe)

    # Weights -------------------------------------------------------------------------------

    async def load_weights(self, version: int, weights: Weights | None) -> None:
        self.check_alive()
        if weights is None:
            fp = hashlib.blake2b(f"gyre-mock-version-{version}".encode(), digest_size=16).digest()
        else:
            fp = await asyncio.to_thread(fingerprint_weights, weights)
        await self.clock.sleep(self.timing.weight_load_s * self.timing.time_scale)
        self._fingerprint = fp
        self._policy_version = version
        self._prefix_cache.clear()  # cached KV belongs to the old weights

    # Pause / sleep -------------------------------------------------------------------------

    async def pause(self) -> None:
        self._unpaused.clear()

    async def resume(self) -> None:
        self._unpaused.set()
        self._wakeup.set()

    async def sleep(self) -> bool:
        if self.running_requests:
            raise FailedPrecondition(f"engine holds {self.running_requests} requests; cannot sleep")
        await self.clock.sleep(self.timing.sleep_s * self.timing.time_scale)
        self._prefix_cache.clear()
        self._sleeping = True
        return True

    async def wake(self) -> None:
        if self._sleeping:
            await self.clock.sleep(self.timing.wake_s * self.timing.time_scale)
            self._sleeping = False

    # KV handoff ----------------------------------------------------------------------------

    async def export_kv(self, request_id: str) -> KvHandle | None:
        req = self._requests.get(request_id)
        if req is None or not req.prefilled:
            return None
        handle_id = f"kv-{self._cell_id}-{uuid.uuid4().hex[:12]}"
        tokens = list(req.context)
        if self._kv_dir:
            path = Path(self._kv_dir) / f"{handle_id}.json"
            payload = json.dumps({"fingerprint": self._fingerprint.hex(), "tokens": tokens})
            await asyncio.to_thread(_write_atomic, path, payload)
            self._kv_handles[handle_id] = str(path)
            handle = KvHandle(handle_id, self._cell_id, len(tokens), str(path), "file")
        else:
            _MEMORY_KV[handle_id] = (self._fingerprint, tokens)
            self._kv_handles[handle_id] = ""
            handle = KvHandle(handle_id, self._cell_id, len(tokens), handle_id, "memory")
        loop = asyncio.get_running_loop()
        self._kv_expiry[handle_id] = loop.call_later(self._kv_pin_ttl_s, self._drop_kv, handle_id)
        return handle

    async def release_kv(self, handle_id: str) -> None:
        self._drop_kv(handle_id)

    @property
    def pinned_kv(self) -> int:
        """KV handles exported and not yet released (or expired)."""
        return len(self._kv_handles)

    def _drop_kv(self, handle_id: str) -> None:
        timer = self._kv_expiry.pop(handle_id, None)
        if timer is not None:
            timer.cancel()
        path = self._kv_handles.pop(handle_id, None)
        _MEMORY_KV.pop(handle_id, None)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _read_handle(self, handle: KvHandle) -> tuple[bytes, list[int]] | None:
        if handle.medium == "memory":
            return _MEMORY_KV.get(handle.locator)
        if handle.medium == "file":
            try:
                data = json.loads(Path(handle.locator).read_text())
            except (OSError, ValueError):
                return None
            return bytes.fromhex(data["fingerprint"]), [int(t) for t in data["tokens"]]
        return None

    def _cached_prefix(self, prompt: list[int], handle: KvHandle | None) -> int:
        cached = self._prefix_cache_hit(prompt)
        if handle is not None:
            got = self._read_handle(handle)
            if got is not None and got[0] == self._fingerprint and prompt[: len(got[1])] == got[1]:
                self.stats.kv_imports += 1
                cached = max(cached, len(got[1]))
            else:
                self.stats.kv_import_misses += 1
        # The last prompt token is always recomputed (it yields the first new token).
        return min(cached, len(prompt) - 1)

    # Prefix cache (hashes of full blocks, LRU) ------------------------------------------------

    def _block_hashes(self, tokens: list[int]) -> list[bytes]:
        out: list[bytes] = []
        h = self._fingerprint
        b = self._block
        for i in range(0, len(tokens) - b + 1, b):
            h = hashlib.blake2b(h + struct.pack(f"<{b}i", *tokens[i : i + b]), digest_size=16).digest()
            out.append(h)
        return out

    def _prefix_cache_hit(self, prompt: list[int]) -> int:
        hit = 0
        for h in self._block_hashes(prompt):
            if h not in self._prefix_cache:
                break
            self._prefix_cache.move_to_end(h)
            hit += self._block
        return hit

    def _remember(self, tokens: list[int]) -> None:
        if self._cache_capacity_blocks <= 0:
            return
        for h in self._block_hashes(tokens):
            self._prefix_cache[h] = None
            self._prefix_cache.move_to_end(h)
        while len(self._prefix_cache) > self._cache_capacity_blocks:
            self._prefix_cache.popitem(last=False)

    # The step loop ---------------------------------------------------------------------------

    def _token(self, context: list[int], sampling: Sampling) -> tuple[int, float]:
        tail = context[-self._window :]
        if sampling.temperature <= 0:
            salt = b""
        elif sampling.seed:
            salt = struct.pack("<q", sampling.seed)
        else:
            salt = self._sampling_salt
        x = int.from_bytes(
            hashlib.blake2b(
                self._fingerprint + salt + struct.pack(f"<{len(tail)}i", *tail), digest_size=8
            ).digest(),
            "little",
        )
        token = self._floor + x % (self._vocab - self._floor)
        raw = -0.001 - ((x >> 32) % 8000) / 1000.0
        return token, mock_logprob(raw, sampling.temperature, self._vocab)

    async def _run(self) -> None:
        try:
            while True:
                await self._unpaused.wait()
                batch = [r for r in list(self._order)[: self._max_batch]]
                if not batch:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                prefills = [(r.ctx - r.cached, r.cached) for r in batch if not r.prefilled]
                decodes = [r.ctx for r in batch if r.prefilled]
                cost = self.timing.step_s(prefills, decodes) * self.timing.time_scale
                await self.clock.sleep(cost)
                self.stats.steps += 1
                self.stats.busy_s += cost
                await self._unpaused.wait()
                for req in batch:
                    if req.request_id not in self._requests or self._requests[req.request_id] is not req:
                        continue  # aborted while the step ran
                    self._advance(req)
                    if 0 <= self.faults.die_after_tokens <= self.stats.tokens:
                        await self.fail(
                            EngineDead(f"mock engine died after {self.stats.tokens} tokens (scripted fault)")
                        )
                        return
                    if 0 <= self.faults.hang_after_tokens <= self.stats.tokens:
                        # Nothing moves any more; only a health probe timeout notices.
                        log.warning("mock engine hangs (scripted fault)")
                        await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the mock is an engine death, like in a real one
            await self.fail(EngineDead(f"mock engine loop crashed: {exc!r}"))
            raise

    def _advance(self, req: _Request) -> None:
        if not req.prefilled:
            req.prefilled = True
            self.stats.prefill_tokens += req.ctx - req.cached
            self.stats.cached_tokens += req.cached
        token, logprob = self._token(req.context, req.sampling)
        req.context.append(token)
        req.generated += 1
        if not req.probe:
            self.stats.tokens += 1
        finish: FinishReason | None = None
        if token in req.sampling.stop_token_ids:
            finish = FinishReason.STOP
        elif req.generated >= req.sampling.max_tokens:
            finish = FinishReason.LENGTH
        chunk = Chunk([token], [logprob], self._policy_version, finish)
        if finish is None:
            req.queue.put_nowait(chunk)
        else:
            self._remember(req.context)
            self._finish(req, chunk)

    def _finish(self, req: _Request, chunk: Chunk) -> None:
        req.queue.put_nowait(chunk)
        self._drop(req)

    def _drop(self, req: _Request) -> None:
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
            try:
                self._order.remove(req)
            except ValueError:
                pass

    async def _fail_waiters(self, exc: EngineDead) -> None:
        for req in list(self._requests.values()):
            req.queue.put_nowait(exc)
            self._drop(req)
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()


def mock_logprob(raw: float, temperature: float, vocab_size: int) -> float:
    """The log-prob the mock reports for an emitted token: what vLLM's processed log-probs
    are (the distribution after temperature), for the mock's model distribution.

    The mock's untempered model puts probability ``p = exp(raw)`` on the emitted token (raw
    is hash-derived, in [-8, -0.001]) and spreads the rest evenly over the other
    ``vocab_size - 1`` ids. Sampled at temperature ``T`` the logits are divided by ``T``:
    the emitted token's log-prob is ``raw/T - log(exp(raw/T) + (V-1) * q**(1/T))`` with
    ``q = (1-p)/(V-1)``. ``T == 1`` gives ``raw`` itself; greedy (``T == 0``) is scored
    untempered (``raw``), as vLLM reports it and the trainer scores it. (The token itself is
    a hash, not a draw from this distribution: the mock's log-probs are consistent numbers
    for the trainer's importance ratios, not a model of sampling.)"""
    if temperature <= 0 or temperature == 1.0 or vocab_size <= 1:
        return raw
    others = math.log(vocab_size - 1)
    log_q = math.log1p(-math.exp(raw)) - others  # each other id's untempered log-prob
    a = raw / temperature  # the emitted token's tempered logit
    b = others + log_q / temperature  # log of every other id's tempered weight, summed
    m = max(a, b)
    return min(0.0, a - (m + math.log(math.exp(a - m) + math.exp(b - m))))


def fingerprint_weights(weights: Mapping[str, Any] | bytes) -> bytes:
    """Content hash of a weight state (a safetensors blob hashes like its tensors)."""
    import torch
    from safetensors.torch import load as st_load

    tensors = st_load(weights) if isinstance(weights, (bytes, bytearray)) else weights
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t: torch.Tensor = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _write_atomic(path: Path, payload: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(payload)
    os.replace(tmp, path)
