#!/usr/bin/env bash
# What only a GPU can show (benchmarks/gpu_check.py), on a machine with an NVIDIA GPU and some torch
# >= 2.7 installed, no network needed. About 5 minutes: each section has its own time limit, and all
# of them together stay within GPU_CHECK_BUDGET_S (default 300 s; a section that no longer fits is
# skipped, and says so).
#
#   bash scripts/gpu_check.sh [--out DIR] [--device cuda|cpu] [--quick] [--sections a,b,...]
#
# Results: DIR/gpu-check.json (every section's JSON, written when the section starts and again when it
# ends) and DIR/summary.txt (one figure line per section, printed again at the end). DIR: --out, else
# $GPU_RESULTS, else $OUT/gpu-results where $OUT is set (the device machine hands back only $OUT),
# else gpu-results/. Exit status: 0 when every section's checks held, 1 when one failed or timed out,
# 2 without python3, torch or a CUDA device (`--device cpu --quick` is the dry run the tests do).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3 || command -v python)}
if [ -z "$PY" ]; then
  echo "gpu_check: no python3 (or python) on PATH; set PYTHON=/path/to/python" >&2
  exit 2
fi
out_dir=${GPU_RESULTS:-${OUT:+$OUT/}gpu-results}
device=cuda
sections=""
pass=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out_dir=${2:?--out needs a folder}; shift 2 ;;
    --device) device=${2:?--device needs cuda or cpu}; pass+=(--device "$2"); shift 2 ;;
    --sections) sections=${2//,/ }; shift 2 ;;
    *) pass+=("$1"); shift ;;
  esac
done

# section:limit in seconds, most telling first (the limits add up to more than the budget: most
# sections end well within theirs; train, which compiles a layer per shape, takes what is left)
all="env:40 contract:45 syncs:75 te_table:90 compile:110 recipes:45 kernels:75 grouped:45 emulation:45 overlap:60 idle:45 train:120"
for section in $sections; do
  if [[ " $all " != *" $section:"* ]]; then
    echo "gpu_check: no section $section; the sections: $(echo "$all" | sed 's/:[0-9]*//g')" >&2
    exit 2
  fi
done

export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# inductor picks cuBLAS GEMMs without autotuning them: minutes saved, the same GEMMs as eager
export TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=${TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS:-ATEN}

"$PY" - "$device" <<'EOF' || exit 2
import sys
try:
    import torch
except Exception as exc:
    sys.exit(f"gpu_check: {sys.executable} cannot import torch ({exc}); install torch >= 2.7 or set PYTHON")
cuda = torch.cuda.is_available()
print(f"gpu_check: {sys.executable}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if cuda else 'none'}")
if sys.argv[1] != "cpu" and not cuda:
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU-only build, no driver, or "
             "CUDA_VISIBLE_DEVICES hides it): nothing to check. `--device cpu --quick` runs the dry run")
EOF

mkdir -p "$out_dir" || exit 2
if [ -z "$sections" ]; then  # a whole run starts afresh; --sections adds to (or redoes) earlier ones
  rm -f "$out_dir/gpu-check.json" "$out_dir/summary.txt"
fi
# GPU_CHECK_LIMIT_FACTOR stretches every limit and the budget (the CPU dry run on a shared machine)
factor=${GPU_CHECK_LIMIT_FACTOR:-1}
budget=$(( ${GPU_CHECK_BUDGET_S:-300} * factor ))
start=$SECONDS
status=0
for entry in $all; do
  section=${entry%%:*}
  limit=$(( ${entry##*:} * factor ))
  if [ -n "$sections" ] && [[ " $sections " != *" $section "* ]]; then
    continue
  fi
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 15 ]; then
    echo "section $section skipped: the budget of ${budget} s is spent (GPU_CHECK_BUDGET_S)" | tee -a "$out_dir/summary.txt"
    status=1
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $section (at most ${limit} s)"
  timeout -k 5 "$limit" "$PY" benchmarks/gpu_check.py "$section" --out "$out_dir" --limit-s "$limit" ${pass[@]+"${pass[@]}"}
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "section $section timed out after $limit s" | tee -a "$out_dir/summary.txt"
    status=1
  elif [ "$rc" -eq 2 ]; then
    exit 2
  elif [ "$rc" -ne 0 ]; then
    status=1
  fi
done
echo "== summary ($((SECONDS - start)) s; results in $out_dir/gpu-check.json)"
cat "$out_dir/summary.txt" 2>/dev/null
exit $status
