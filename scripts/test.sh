#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest, e.g. -m "not multirank".
# Two workers (pytest-xdist; CI has two cores), whole files to a worker (a file's module fixtures run
# once); `-n 0` runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
