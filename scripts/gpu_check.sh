#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA correctness checks, the GPU benchmark, a 1-GPU demo and the
# test suite. Prepared for a session that is lent a device; each part has its own time bound.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
python -m pip install -q -e ".[test,demo]" 2>&1 | tail -1 || true   # the device's own torch stays
timeout 120 python benchmarks/cuda_check.py | tee "$OUT/cuda_check.txt"
timeout 240 python -m fp8train bench gpu step --out "$OUT" | tee "$OUT/bench.txt"
timeout 120 python -m fp8train demo --device cuda --world-size 1 --steps 60 --run-dir "$OUT/demo" | tail -15
timeout 300 python -m pytest -q -x -m "not soak" | tail -3
