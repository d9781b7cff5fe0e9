#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 and fp8train (editable) plus extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || pip install -q torch==2.13.0
python -c "import fp8train, numpy, pytest, hypothesis, matplotlib, tqdm, transformers, tensorboard, torchao, accelerate, safetensors, lightning, peft" 2>/dev/null \
  || pip install -q -e ".[test,demo]"
# torchtitan's CPU tests: its model package imports triton even on a CPU-only torch; its own
# requirements (datasets, wandb, torchdata) serve only its trainer, so the pieces it imports are named
python -c "import torchtitan.models.llama3" 2>/dev/null \
  || pip install -q --no-deps torchtitan==0.3.0 triton==3.9.0 spmd_types==0.2.3 tyro docstring_parser typeguard einops
