#!/usr/bin/env bash
# Set up (if needed) and run the demo on CPU. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python examples/train_small.py "$@"
