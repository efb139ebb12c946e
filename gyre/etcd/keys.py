"""The key layout of one Gyre cluster in etcd; every key lives under /gyre/<cluster>/."""

from __future__ import annotations


class Keys:
    """Builds keys for one cluster. Keys are bytes, as etcd wants them."""

    def __init__(self, cluster: str) -> None:
        if not cluster or "/" in cluster:
            raise ValueError(f"bad cluster name {cluster!r}")
        self.root = f"/gyre/{cluster}/"

    def _k(self, *parts: object) -> bytes:
        return (self.root + "/".join(str(p) for p in parts)).encode()

    # Liveness and registration (lease-bound).
    def cells(self) -> bytes:
        return self._k("cells", "")

    def cell(self, cell_id: str) -> bytes:
        return self._k("cells", cell_id)

    def services(self, kind: str) -> bytes:
        return self._k("services", kind, "")

    def service(self, kind: str, instance: str) -> bytes:
        return self._k("services", kind, instance)

    # Scheduler leadership: the create-revision of this key is the fencing epoch.
    def leader(self) -> bytes:
        return self._k("scheduler", "leader")

    # Cell role state, written by the cell agent under the leader's fence.
    def cell_states(self) -> bytes:
        return self._k("cell_state", "")

    def cell_state(self, cell_id: str) -> bytes:
        return self._k("cell_state", cell_id)

    # The execution ledger: one key per execution (independent records, see docs/design/tooling.md).
    def executions(self, burst_id: int | None = None) -> bytes:
        return (
            self._k("ledger", "exec", "")
            if burst_id is None
            else self._k("ledger", "exec", f"{burst_id:08d}", "")
        )

    def execution(self, burst_id: int, execution_id: str) -> bytes:
        return self._k("ledger", "exec", f"{burst_id:08d}", execution_id)

    def burst(self, burst_id: int) -> bytes:
        return self._k("ledger", "burst", f"{burst_id:08d}")

    def bursts(self) -> bytes:
        return self._k("ledger", "burst", "")

    # Archived bursts, folded into one summary record (services/scheduler/ledger.py).
    def ledger_summary(self) -> bytes:
        return self._k("ledger", "summary")

    # Routes: execution -> engine, with an epoch (the key's version).
    def routes(self) -> bytes:
        return self._k("routes", "")

    def route(self, execution_id: str) -> bytes:
        return self._k("routes", execution_id)

    # Transitions in progress (resumable after a scheduler restart).
    def transition(self, cell_id: str) -> bytes:
        return self._k("transitions", cell_id)

    def transitions(self) -> bytes:
        return self._k("transitions", "")

    # Policy versions.
    def policy(self) -> bytes:
        return self._k("policy", "version")
