#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest, e.g. -m "not multirank".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
exec python -m pytest -q "$@"
