"""Gyre: elastic GPU scheduling for reinforcement learning of long-horizon agents.

Shared code for every service lives in this package; the generated protobuf modules live in
``gyre.v1``. Importing ``gyre`` pulls in nothing heavy (no torch, no vLLM, no etcd client).
"""

__version__ = "0.1.0"
