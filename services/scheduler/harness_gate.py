"""Who a harness is, and how much it may take (pure: no grpc, no etcd; injectable clock).

A harness proves who it is with an API key (``x-gyre-api-key``, checked against the hashed
keys file, see :mod:`gyre.apikeys`) or with its client certificate (role ``harness``; the
certificate's name is the harness). That name, the *principal*, owns the executions the
harness acquires: another harness cannot heartbeat or finish them even with their token.
Per principal the gate enforces a rate of AcquireExecution calls (a token bucket) and a cap
on executions held at once. Over either limit: RESOURCE_EXHAUSTED, nothing changed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from gyre.apikeys import METADATA_KEY, KeyFile
from gyre.errors import PermissionDenied, RateLimited, ResourceExhausted, Unauthenticated
from gyre.identity import Identity, Role
from gyre.ratelimit import KeyedLimiter


class HarnessGate:
    """Authenticates harnesses and applies their limits."""

    def __init__(
        self,
        *,
        keys: KeyFile | None,
        require_key: bool = False,
        max_inflight: int = 0,
        rate_per_s: float = 0.0,
        burst: int = 1,
        trust_unauthenticated: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = keys
        self._require_key = require_key
        self._max_inflight = max_inflight
        self._acquires = KeyedLimiter(rate_per_s, max(1, burst), clock=clock)
        self._trust = trust_unauthenticated
        self.held: Counter[str] = Counter()

    def principal(self, identity: Identity | None, api_key: str | None, claimed: str = "") -> str | None:
        """The authenticated harness name, or UNAUTHENTICATED.

        ``identity`` is the verified certificate (None without mTLS); ``api_key`` the
        presented key; ``claimed`` the request's harness_id, trusted (None when empty: no
        owner to compare) only when the operator turned every check off
        (``tls.insecure`` and no keys file)."""
        if api_key is not None:
            if self._keys is None:
                raise Unauthenticated("this scheduler takes no API keys (no harness_keys_file)")
            name = self._keys.verify(api_key)
            if name is None:
                raise Unauthenticated("unknown API key")
            return f"key:{name}"
        if self._require_key:
            raise Unauthenticated(f"a harness API key is required ({METADATA_KEY} metadata)")
        if identity is not None and identity.role is Role.HARNESS:
            return identity.name
        if identity is None and self._trust:
            return claimed or None
        raise Unauthenticated("a harness credential is required (a harness certificate or an API key)")

    def admit_acquire(self, principal: str) -> None:
        """One AcquireExecution call against the principal's rate; RESOURCE_EXHAUSTED over it."""
        retry = self._acquires.take(principal)
        if retry > 0:
            raise RateLimited(
                f"harness {principal} is over {self._acquires.rate:g} acquires/s; retry in {retry:.2f} s"
            )

    def check_inflight(self, principal: str) -> None:
        """RESOURCE_EXHAUSTED when the principal already holds its cap of executions."""
        if self._max_inflight and self.held[principal] >= self._max_inflight:
            raise ResourceExhausted(
                f"harness {principal} holds {self.held[principal]} executions (limit {self._max_inflight}); "
                "finish some first"
            )

    def launched(self, principal: str) -> None:
        self.held[principal] += 1

    def closed(self, principal: str) -> None:
        if self.held[principal] > 0:
            self.held[principal] -= 1
        if self.held[principal] == 0:
            del self.held[principal]

    def recount(self, running_owners: Iterable[str]) -> None:
        """Rebuilds the held counts (a new leader, from the ledger's open executions)."""
        self.held = Counter(o for o in running_owners if o)

    @staticmethod
    def check_owner(owner: str, principal: str | None) -> None:
        """PERMISSION_DENIED when ``principal`` is not the harness that acquired the execution
        (None: no authentication configured, nothing to compare)."""
        if principal is not None and owner and owner != principal:
            raise PermissionDenied("this execution belongs to another harness")
