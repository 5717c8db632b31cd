#!/usr/bin/env bash
# Create .venv with the CPU stack: torch 2.13.0 (CPU wheel; pinned so pip never pulls CUDA builds),
# megatron-core, math-verify, transformers (model bridge, CPU eval) and this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,hf]"
# shellcheck lints launch/ in the tests (skipped with a reason when it cannot be installed)
if ! command -v shellcheck >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq shellcheck) >/dev/null 2>&1 || echo "shellcheck not installed"
fi
python -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
