"""A cluster YAML for one cell agent process (mock engine, fast probes and leases) on a test
etcd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_cell_config(tmp_path: Path, etcd_server: Any, cluster_name: str, **cell: Any) -> str:
    """Writes ``cluster.yaml`` under ``tmp_path`` for cell ``cell-p`` (``cell`` overrides its
    section) and returns its path."""
    cfg = {
        "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        "cell_agent": {
            "cell_id": "cell-p",
            "kind": "elastic",
            "index": 0,
            "slots": 4,
            "engine": "mock",
            "mock": {"fixed_decode_step_s": 0.002},
            "probe_interval_s": 0.5,
            "lease_ttl_s": 3,
            "drain_wait_s": 0.5,
            "log_json": False,
            **cell,
        },
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
