#!/usr/bin/env bash
# Create .venv (if needed) with the CPU build of torch 2.13.0 and fp8train (editable), plus what a
# command needs. Idempotent.
#   bash scripts/setup.sh demo   the demo's extra only (matplotlib, tqdm): what scripts/demo.sh runs
#   bash scripts/setup.sh [test] the test stack as well (pytest, the frameworks, torchao, torchtitan):
#                                what scripts/test.sh (and so .ci/run, from a fresh clone) runs
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
case $what in
  demo | test) ;;
  *) echo "setup.sh: the argument is demo or test, got '$what'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || pip install -q torch==2.13.0
if [ "$what" = demo ]; then
  python -c "import fp8train, matplotlib, tqdm" 2>/dev/null || pip install -q -e ".[demo]"
  exit 0
fi
python -c "import fp8train, numpy, pytest, xdist, hypothesis, matplotlib, tqdm, transformers, tensorboard, torchao, accelerate, safetensors, lightning, peft, pdoc, setuptools" 2>/dev/null \
  || pip install -q -e ".[test,demo]"
# torchtitan's CPU tests: its model package imports triton even on a CPU-only torch; its own
# requirements (datasets, wandb, torchdata) serve only its trainer, so the pieces it imports are named
python -c "import torchtitan.models.llama3" 2>/dev/null \
  || pip install -q --no-deps torchtitan==0.3.0 triton==3.9.0 spmd_types==0.2.3 tyro docstring_parser typeguard einops
