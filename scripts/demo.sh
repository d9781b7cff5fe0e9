#!/usr/bin/env bash
# Set up (if needed) and run the demo: 2 CPU ranks (torchrun, gloo) train a small GPT in FP8, then the
# same model with the other amax-reduction mode and in fp32; prints a summary and writes a report under
# runs/demo-<timestamp>/. Extra arguments go to `fp8train demo` (see `python -m fp8train demo --help`).
# Installs only what the demo needs (torch and the demo extra); scripts/test.sh adds the test stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. .venv/bin/activate
exec python -m fp8train demo "$@"
