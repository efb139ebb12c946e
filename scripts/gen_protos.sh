#!/usr/bin/env bash
# Generates gyre/v1/*_pb2.py, *_pb2_grpc.py and *.pyi from protos/gyre/v1/*.proto.
# The generated code is committed (so the harness client imports without grpcio-tools and
# reviews show API changes); tests/unit/test_protos_fresh.py fails when it is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${1:-.}
"$PY" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/gyre/v1/*.proto
touch "$out/gyre/v1/__init__.py"
