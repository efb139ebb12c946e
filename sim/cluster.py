"""The simulated cluster: cells with engines and a streaming trainer, executions, the ledger,
and the GPU-second accounts. It owns the mechanism (what happens when a cell moves, how a
request is rerouted, how training consumes groups); the decisions come from the scheduler's
policy through ``sim.driver``.

Engines use a fluid decode model: every active sequence of an engine gains one token per
step and the step time is the cost model's (bytes read), integrated exactly between events
(``DecodeRate``). Prefill and weight loads stall the engine's decode (they are queued GPU
work on the same device). An engine holds at most ``CostConfig.kv_capacity_tokens`` of KV, as
vLLM's block manager does: a turn is admitted only when its context fits beside the running
sequences' (else it waits, first in first out); the prefixes of executions waiting on a tool
stay cached until the space is needed (least recently used first; an evicted prefix is
prefilled again on the next turn); and when the running sequences' growth fills the KV, the
youngest is preempted and recomputed on readmission (vLLM's recompute preemption).
Training consumes ready groups first-in first-out at the summed throughput of the cells that
have joined the stream. The cells, their engines and the execution records are in
``sim.engine``.

:class:`Cluster` is the mechanism that moves work between them, assembled from one layer per
concern, each a class in its own module over the layers it uses, all on one object (so the
per-event paths call methods and read attributes of ``self`` as before, with no delegation):

* ``sim.cluster_state`` - :class:`ClusterState`: cells, trainer, queues, ledgers, counters;
* ``sim.decode`` - KV admission, prefill, preemption, each engine's decode events;
* ``sim.routing`` - dispatch, placement, turns and closes, reroutes, ``Migrate``, ``PlanMoves``;
* ``sim.bursts`` - the rule for unconsumable groups: cancel early, or restamp (partial);
* ``sim.training`` - the trainer's stream, optimizer step and sealing, the ready rate
  (the batch's state is ``sim.trainer``);
* ``sim.roles`` - role switches, joins to the stream, publication of a version.
"""

from __future__ import annotations

from sim.engine import CATEGORIES as CATEGORIES  # re-exported: the accounts' categories
from sim.engine import ExecState as ExecState
from sim.engine import Group as Group
from sim.engine import Role as Role
from sim.roles import Roles


class Cluster(Roles):
    """The world the policy acts on. Public methods are the mechanism behind each action."""

    def capacity(self) -> int:
        return sum(c.slots for c in self.cells if c.role is Role.ROLLOUT)

    def finish(self, t: float) -> None:
        """Closes the accounts at time t."""
        for c in self.cells:
            c.account(t)
