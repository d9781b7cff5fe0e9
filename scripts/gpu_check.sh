#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and torch installed (no network needed): what only a GPU can show
# (benchmarks/gpu_check.py), as JSON under $GPU_RESULTS (default gpu-results/). Each section has its
# own time bound; together they stay under 7 minutes. Exits non-zero if a section failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export GPU_RESULTS=${GPU_RESULTS:-gpu-results}
mkdir -p "$GPU_RESULTS"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
for section_and_limit in paths:45 emulation:60 syncs:90 speed:150 idle:60; do
  section=${section_and_limit%%:*}
  limit=${section_and_limit##*:}
  echo "== $section (at most ${limit} s)"
  timeout "$limit" python benchmarks/gpu_check.py "$section" "$@" || status=1
done
echo "results in $GPU_RESULTS/"
exit $status
