"""The etcd control plane on aetcd: one client per process, leases, CAS, election, watches."""

from gyre.etcd.client import KV, Etcd, Op
from gyre.etcd.election import LeaderElection
from gyre.etcd.keys import Keys
from gyre.etcd.lease import LeaseKeeper
from gyre.etcd.watch import PrefixMirror

__all__ = ["KV", "Etcd", "Op", "Keys", "LeaseKeeper", "LeaderElection", "PrefixMirror"]
