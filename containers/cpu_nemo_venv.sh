#!/bin/bash
# CPU virtual environment with the real nemo-toolkit 2.2.1 / nemo-aligner 0.7.0 / megatron-core 0.11
# packages, for the `nemo` test tier (tests/test_nemo_aligner.py, tests/test_nemo_cluster.py) on machines without GPUs or the
# NGC container. About 2.5 minutes with a warm pip cache.
#
#   bash containers/cpu_nemo_venv.sh .venv-nemo
#   PYTHONPATH=$PWD .venv-nemo/bin/python -m pytest tests/test_nemo_aligner.py tests/test_nemo_cluster.py -m nemo
set -euo pipefail
VENV="${1:-.venv-nemo}"
python3 -m venv "${VENV}"
"${VENV}/bin/pip" install -q --upgrade pip
"${VENV}/bin/pip" install -q torch==2.13.0            # CPU wheel; pinned below so nothing replaces it
echo "torch==2.13.0" > "${VENV}/constraints.txt"
"${VENV}/bin/pip" install -q -c "${VENV}/constraints.txt" "nemo-toolkit[nlp]==2.2.1" megatron-core==0.11.0 \
    nemo-aligner==0.7.0 omegaconf pytest jsonlines "pangu==4.0.6.1"
# NeMo's Chinese tokenizer imports pangu.spacing (gone in pangu 6), hence the pin above. The
# torchvision wheel pulled by the NLP extras is built for another torch and breaks torchmetrics'
# import; NeMo's language models do not need it.
"${VENV}/bin/pip" uninstall -q -y torchvision || true
"${VENV}/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__)"
