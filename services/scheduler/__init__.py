"""The Gyre scheduler: bursts, the execution ledger, the waterlevel, cell roles, transitions.

Modules, by concern (``scheduler`` composes them; each has a typed interface):

* pure: ``policy`` (role decisions from a snapshot: gyre, the default; waterlevel;
  the baselines colocated, static, async-static, async-static-lend; rollout_only),
  ``ledger`` (D / L / F, exactly-once close; the counts are its ``accounts``), ``placement``
  (cell/route tables, placement order);
* ``leadership`` (epoch, deposition, the fenced ``store``: its ``Store`` protocol and the
  etcd ``SchedulerStore``), ``fleet`` (cells, routes, routers, engine versions, commands
  to cell agents), ``bursts`` (dispatch), ``executions`` (acquire, heartbeat, finish,
  time-outs), ``relay`` (finish reports to the packer), ``supply`` (the packer's supply
  signal), ``publication`` (policy versions onto rollout engines), ``transitions`` (role
  moves, reroutes, rescues, resumable), ``joins`` (JoinBatch of training cells),
  ``commands`` (the policy's actions, one ``match``), ``control`` (the control loop, the
  snapshot), ``status`` (typed GetStatus), ``telemetry`` and ``events`` (events, metrics,
  wake-ups), ``harness_gate``, ``history``, ``tasks``, ``peers`` (outgoing gRPC),
  ``servicer`` (gRPC edge), ``config``; ``parts`` (``Shared``, what every part is built
  with).

What it writes in etcd (all with ``LeaderElection.fenced_txn``):

* ``keys.burst(b)``: ``{"burst_id", "policy_version", "target_version", "group_size",
  "tasks": [[task_id, task_json], ...], "dispatched_s"}``; D of the burst = tasks x group_size.
* ``keys.execution(b, id)``: ``{"execution_id", "burst_id", "seq", "group_id", "task_id",
  "policy_version", "state" (RUNNING | COMPLETED | FAILED | TIMED_OUT | CANCELLED),
  "token_sha256", "harness_id", "launched_s", "finished_s", "reward", "idempotency_key"}``,
  created at launch (L), rewritten once at close (F) and, under the partial rule, when its
  group is restamped (``policy_version`` raised while it runs). Execution ids:
  ``b<burst>-t<i>-<m>``, groups ``b<burst>-t<i>``. A close by the scheduler's cancel-early
  rule has ``idempotency_key`` ``scheduler-cancel``; a queued execution it withdraws gets its
  record created closed (no token). The per-version ledger is derived from these records
  (each burst's ``policy_version`` is the stamp of its groups, unless a member's record
  carries a newer one): no counter key is shared.
* ``keys.route(id)`` as in the conventions (deleted at close; version = route epoch).
* ``keys.transition(cell)``: ``{"cell_id", "target", "reason", "epoch"}`` while a move runs.
* the leader key's value: ``{"instance", "target"}`` (a standby names the leader in its
  UNAVAILABLE answer; HarnessService health is NOT_SERVING on a standby).

It reads ``keys.cell``/``keys.cell_state`` (capacity, roles), ``keys.policy()`` (a new
version ends the burst), ``services/router/*`` (MoveExecutions targets), and the packer's
WatchSupply stream. Event kinds on WatchEvents: burst_started, cell_to_training,
cell_to_rollout, core_kept, policy_published, batch_sealed, hold, reroute, rescued,
cell_in_training, cell_in_rollout, joined_batch, timed_out, leader, transition_resumed,
cancelled, restamped, migrated, moves_planned, ...
"""
