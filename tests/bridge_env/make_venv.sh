#!/usr/bin/env bash
# TEST ENVIRONMENT ONLY (CI's Python 3.12 job): a CPU venv with real megatron-core 0.19.2, Megatron-Bridge 0.6.2,
# transformers 5.17 and compressed-tensors for the tests marked `bridge`.
# Usage: bash tests/bridge_env/make_venv.sh VENV_DIR
# PyPI's torch for 3.12 is the CUDA build (runs on CPU; about 5 GB). Transformer Engine is NOT installed (with TE
# present but no GPU, megatron-core does not import); tests import tests/bridge_env/shims.py (import-only
# stand-ins) before megatron.bridge. Users run Bridge in the NeMo container instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:?usage: make_venv.sh VENV_DIR}
# pyenv's 3.12 on the project's CPU machines (not the default python3); elsewhere python3.12 on PATH
py312=$(PYENV_VERSION=3.12.1 python3 -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' \
        2>/dev/null || python3.12 -c 'import sys; print(sys.executable)')
"$py312" -m venv "$venv"
pip="$venv/bin/python -m pip install -q --disable-pip-version-check"
$pip torch==2.11.0 transformers==5.17.0 tokenizers safetensors
$pip megatron-core==0.19.2 numpy packaging psutil
grep -v '^#' "$here/requirements-nodeps.txt" | xargs $pip --no-deps
$pip hydra-core==1.3.8 omegaconf==2.3.0 tqdm pyyaml einops rich pandas pyarrow fsspec xxhash requests aiohttp \
    huggingface_hub scipy matplotlib tensorboard pytest pytest-timeout
# lm-evaluation-harness and its HF backend's accelerate: tests/hf/test_lm_eval.py (neither changes torch/transformers)
$pip lm-eval==0.4.13 accelerate==1.16.0
# compressed-tensors: transformers loads a QAD student's quantized export through it (test_quant_export.py)
$pip compressed-tensors==0.20.1
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$here'); import shims; from megatron.bridge import AutoBridge; \
import megatron.core as m; print('bridge test env ok: megatron-core', m.__version__)"
