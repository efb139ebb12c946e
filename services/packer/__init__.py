"""The packer: trajectory buffer, ready groups, GRPO advantages, micro-step packing and
atomic claims (docs/architecture.md, "Streaming training").

How it behaves, in one place (details in each module):

- Turns (router) and finish reports (scheduler) are joined per execution; a group is ready
  ``ready_grace_s`` after its ``group_size``-th execution closed (turns still queued at the
  router get in), and after a restart not before ``restart_grace_s`` (turns the routers
  queued while the packer was down get in). A turn arriving later is refused
  (FAILED_PRECONDITION, counted as ``late_turns``). A finish for an execution with no turn is accepted: it made no call.
- Failed/timed-out/cancelled members: ``failed_member_rule`` drop_group (reason
  failed_group) or keep_rest (their turns: failed_execution). Zero-variance groups and
  groups older than ``max_staleness`` versions (by their oldest token; by their stamp under
  ``stale_rule: partial``, where a restamped group keeps older tokens) are dropped with
  their reason. Every turn is
  accounted for: produced = consumed + buffered + sum(dropped), rechecked on every change.
- Batches: batch 1 exists from the start; the first claim pins its weight version and
  activates it; ready groups are then assigned to it and packed (first-fit decreasing under
  ``micro_step_token_budget``; full-enough bins at once, the rest when a claimer waits or
  the batch is sealed). ``batch_size`` groups seal it (or SealBatch at burst end) and open
  the next. CLOSED once every micro-step is claimed; only cells that took part may still
  take a micro-step returned by a lapsed claim (TTL, or their etcd registration vanished).
- Claims and acks come batched: ClaimMicroSteps takes up to ``max_micro_steps`` micro-steps
  of a batch in one call (idempotent on the cell's claim id), AckMicroSteps acknowledges
  several in one call, all or nothing; one WAL flush each.
- Supply (WatchSupply): groups with unclaimed work in the batch open to joiners, plus the
  ready groups waiting for it, capped by what it still needs.
- Durability: an fsync'd, checksummed WAL of events in ``wal_dir`` (:mod:`.wal` says why
  not etcd), compacted to snapshots; tied to the cluster's incarnation through etcd.
"""
