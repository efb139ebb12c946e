"""The cell lifecycle as designed, for tests that check the code against it."""

from __future__ import annotations

from gyre.etcd.values import CellState

S = CellState

# The lifecycle of the design (docs/architecture.md, "Rerouting a live execution"), written out here
# rather than read from the code's table: STARTING -> ROLLOUT -> DRAINING -> TRAINING ->
# RETURNING -> ROLLOUT, a drain may be called off (DRAINING -> ROLLOUT), anything may fail.
ALLOWED = {
    (S.STARTING, S.ROLLOUT),
    (S.ROLLOUT, S.DRAINING),
    (S.DRAINING, S.TRAINING),
    (S.DRAINING, S.ROLLOUT),
    (S.TRAINING, S.RETURNING),
    (S.RETURNING, S.ROLLOUT),
    *((source, S.FAILED) for source in S if source is not S.FAILED),
}
