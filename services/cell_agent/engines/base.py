"""The one engine interface of a cell: token ids in, a stream of token chunks out.

Every engine (vLLM, the mock) implements :class:`Engine`. The cell agent, the servicer and
the tests see only this interface. Domain types here are plain dataclasses; protos are
converted at the edge (``from_proto`` / ``to_proto``), after validation.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gyre.errors import FailedPrecondition, InvalidArgument, Unavailable
from gyre.kv import KvHandle  # noqa: F401  (re-exported)
from gyre.sampling import Sampling  # noqa: F401  (re-exported)
from gyre.tokens import Chunk, FinishReason  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

Weights = Mapping[str, Any] | bytes
"""A weight state: ``{name: torch.Tensor}`` or a safetensors blob."""


class EngineDead(Unavailable):
    """The engine died or hung. Every waiter gets this; the process then exits non-zero so
    its lease lapses (crash-only). Maps to UNAVAILABLE, so a router retries elsewhere."""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the scheduler needs of an engine: its kind, load and policy version."""

    engine: str
    running_requests: int
    policy_version: int
    sleeping: bool


class Engine(abc.ABC):
    """A token-in/token-out inference engine.

    Contract:
    * :meth:`generate` yields :class:`Chunk` s; the last one carries ``finish_reason``.
      Cancelling the consumer aborts the engine request. Under greedy sampling, generating
      ``n`` tokens equals generating ``k`` and then continuing from prompt + those ``k`` with
      ``n - k`` (the continuation contract a reroute relies on).
    * A dead or hung engine fails every waiter with :class:`EngineDead` (see :meth:`fail`).
    * :meth:`load_weights` replaces the weights in place; requests in flight continue and
      their later chunks carry the new version.
    """

    kind: str = "abstract"

    def __init__(self, policy_version: int = 0) -> None:
        self._policy_version = policy_version
        self._dead: BaseException | None = None
        self._probe_ids = itertools.count()
        self._sleeping = False
        self.died = asyncio.Event()
        """Set when the engine is declared dead (the cell's monitor waits on it)."""

    # Lifecycle -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model and starts serving."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stops the engine; in-flight requests end (aborted)."""

    # Serving -------------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        required_policy_version: int = 0,
        kv_handle: KvHandle | None = None,
    ) -> AsyncIterator[Chunk]:
        """Streams the tokens of one request (checks shared preconditions first)."""
        self.check_alive()
        if not prompt_token_ids:
            raise InvalidArgument("prompt_token_ids is empty")
        if required_policy_version and required_policy_version != self._policy_version:
            raise FailedPrecondition(
                f"engine serves policy {self._policy_version}, request requires {required_policy_version}"
            )
        return self._generate(request_id, list(prompt_token_ids), sampling, kv_handle)

    @abc.abstractmethod
    def _generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Sampling, kv_handle: KvHandle | None
    ) -> AsyncIterator[Chunk]:
        """The engine-specific stream."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Aborts a request; True if it was running. Unknown ids are not an error."""

    @property
    @abc.abstractmethod
    def running_requests(self) -> int:
        """Requests the engine holds now (waiting or running)."""

    @property
    def kv_tokens(self) -> int:
        """Tokens the engine's KV cache holds (0: unknown). The scheduler counts a rollout
        cell as the executions this keeps resident at the measured mean context."""
        return 0

    async def probe(self, timeout_s: float) -> None:
        """Health probe: generates one token. Raises :class:`EngineDead` on a timeout or an
        error, after failing every waiter."""
        self.check_alive()
        rid = f"probe-{next(self._probe_ids)}"
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self._generate(rid, list(range(3, 11)), Sampling(max_tokens=1), None):
                    pass
        except TimeoutError as exc:
            err = EngineDead(f"{self.kind} engine health probe timed out after {timeout_s}s")
            await self.fail(err)
            raise err from exc
        except EngineDead:
            raise
        except Exception as exc:
            err = EngineDead(f"{self.kind} engine health probe failed: {exc!r}")
            await self.fail(err)
            raise err from exc

    # Weights -------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @abc.abstractmethod
    async def load_weights(self, version: int, weights: Weights | None) -> None:
        """Replaces the weights in place and serves ``version`` from now on."""

    # Pause / sleep -------------------------------------------------------------------------

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stops scheduling; requests in flight are kept (frozen) until :meth:`resume`."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resumes after :meth:`pause`."""

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    @abc.abstractmethod
    async def sleep(self) -> bool:
        """Releases rollout resources (KV cache, buffers) while the cell trains. Requires no
        request in flight. Returns True if memory was actually released, False for the
        fallback (caches cleared, memory kept) where the platform cannot sleep."""

    @abc.abstractmethod
    async def wake(self) -> None:
        """Restores rollout resources after :meth:`sleep`."""

    # KV handoff ----------------------------------------------------------------------------

    async def export_kv(self, request_id: str) -> KvHandle | None:
        """Pins a request's KV blocks and says where to read them; None when the engine
        cannot export (the destination recomputes the prefix)."""
        return None

    async def release_kv(self, handle_id: str) -> None:  # noqa: B027 (an engine without handoff pins nothing)
        """Releases pinned blocks (idempotent); engines that pin nothing keep this no-op."""

    # Failure -------------------------------------------------------------------------------

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(str(self._dead))

    async def fail(self, exc: BaseException) -> None:
        """Marks the engine dead and fails every waiter with ``exc``. Idempotent."""
        if self._dead is None:
            self._dead = exc
            self.died.set()
            log.error("engine dead", extra={"engine": self.kind, "error": str(exc)})
            await self._fail_waiters(EngineDead(str(exc)))

    @abc.abstractmethod
    async def _fail_waiters(self, exc: EngineDead) -> None:
        """Ends every open stream with ``exc``."""

    def info(self) -> EngineInfo:
        return EngineInfo(self.kind, self.running_requests, self._policy_version, self._sleeping)
