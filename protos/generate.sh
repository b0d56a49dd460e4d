#!/usr/bin/env bash
# The one way to regenerate the gRPC stubs: run from anywhere, commits nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
cd "$root"
export PATH="$(dirname "$py"):$PATH"
rm -f protos/*_pb2.py protos/*_pb2.pyi protos/*_pb2_grpc.py
"$py" -m grpc_tools.protoc -I. \
  --python_out=. --mypy_out=. --grpc_python_out=. --mypy_grpc_out=. \
  protos/*.proto
