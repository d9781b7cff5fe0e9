#!/usr/bin/env bash
# The lowest supported torch (pyproject's torch>=2.7), checked by hand: a venv with torch 2.7.1 (PyPI's
# CUDA build, ~3 GB with its CUDA libraries; it runs on the CPU) runs the suite on this checkout.
# Left out: tests/recipes/test_microscaling.py (its oracle, torchao 0.18, needs a newer torch) and the
# framework integrations, tests/hosts/ (only transformers, for the Conv1D tests, is installed there).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOWEST_TORCH_VENV:-/tmp/fp8train-torch-2.7}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.7.1')" 2>/dev/null \
  || "$VENV/bin/pip" install -q torch==2.7.1 "numpy<2.3" pytest hypothesis matplotlib tqdm transformers
PYTHONPATH="$PWD/src" exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not soak and not integration" \
  --ignore tests/recipes/test_microscaling.py --ignore tests/hosts "$@"
