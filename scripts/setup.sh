#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 and fp8train (editable) plus extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || pip install -q torch==2.13.0
python -c "import fp8train, pytest, hypothesis, matplotlib, tqdm, transformers, tensorboard, torchao, accelerate, safetensors, lightning" 2>/dev/null \
  || pip install -q -e ".[test,demo]"
