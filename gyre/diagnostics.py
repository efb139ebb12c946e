"""The training diagnostics every status carries, named once: the scalar fields of
``gyre.v1.TrainingDiagnostics`` (the proto is their one definition) and the bound on its
lag histogram. The scheduler builds them from the policy record, the dashboard keeps them
per version; both read the names from here."""

from __future__ import annotations

from gyre.v1 import scheduler_pb2

TRAINING_SCALARS: tuple[str, ...] = tuple(
    f.name
    for f in scheduler_pb2.TrainingDiagnostics.DESCRIPTOR.fields
    if f.name != "policy_version" and not f.is_repeated
)
"""``tokens``, ``clip_fraction``, the behaviour-weight figures, ``entropy``,
``logprob_gap_lag0``, ``lag_mean``, ``grad_norm``: in the proto's order."""

MAX_LAG_BUCKETS = 16
"""The most lag-histogram buckets a status may carry (the trainer sends 8)."""
