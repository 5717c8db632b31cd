#!/bin/bash
# CPU virtual environment for the `integrations` test tier (tests/test_integrations_trl.py,
# tests/test_integrations_verl.py): this package with its [trl] extra (TRL 1.16.0, accelerate, datasets), and
# verl 0.9.1 installed WITHOUT its dependencies (ray[default], vLLM, wandb, flash-attn, ...) plus the few packages
# that its advantage registry, trainer functions and checkpoint callback import; none of them needs a GPU.
#
#   bash containers/cpu_integrations_venv.sh .venv-integrations
#   LACONIC_INTEGRATIONS_REQUIRED=1 PYTHONPATH=$PWD .venv-integrations/bin/python -m pytest -q \
#       tests/test_integrations_trl.py tests/test_integrations_verl.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-integrations}"
python3 -m venv "${VENV}"
PIP=("${VENV}/bin/pip" install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0                              # CPU wheel; pinned below so nothing replaces it
echo "torch==2.13.0" > "${VENV}/constraints.txt"
# this package with [trl], and what verl's core_algos, ray_trainer / v1 utils, checkpoint_callback and
# checkpoint_manager import (the versions the plug-in was tested with); then verl itself without its dependencies
"${PIP[@]}" -c "${VENV}/constraints.txt" -e ".[trl]" pytest \
    ray==2.60.0 tensordict==0.10.0 codetiming==1.4.0 hydra-core==1.3.8 torchdata==0.11.0 peft==0.21.2 \
    cachetools==8.0.2 uvicorn==0.54.0 fastapi==0.165.0 TransferQueue==0.1.11 pillow==13.0.0
"${PIP[@]}" -c "${VENV}/constraints.txt" --no-deps verl==0.9.1
"${VENV}/bin/python" -c "import torch, trl, verl; assert torch.__version__.startswith('2.13.0'), torch.__version__; \
print('torch', torch.__version__, '| trl', trl.__version__, '| verl', verl.__version__)"
